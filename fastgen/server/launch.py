"""Running a server: ``fastgen serve`` in this process (:func:`run_server`), local replicas as
child processes, and :func:`serve`, which starts ``fastgen serve`` in the background and hands
back a client once it is healthy.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from .config import ServerConfig

API_KEY_ENV = "FASTGEN_API_KEY"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a child: get SIGTERM when the parent dies, so no replica outlives its balancer."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def spawn_server(config: ServerConfig, *, new_session: bool = False) -> subprocess.Popen:
    """``fastgen serve`` with ``config`` in a child process (its output goes to ours)."""
    env = dict(os.environ)
    if config.api_keys:
        env[API_KEY_ENV] = "\n".join(config.api_keys)
    else:
        env.pop(API_KEY_ENV, None)
    argv = [sys.executable, "-m", "fastgen.cli", "serve", *config.to_argv()]
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=new_session,
                            preexec_fn=None if new_session else _die_with_parent)


def replica_config(config: ServerConfig, port: int, index: int = 0) -> ServerConfig:
    """Replica ``index`` of ``config``: loopback only, its share of the cores unless told
    otherwise, and its own trace file (``PATH.index``)."""
    options = dict(config.engine_options)
    if options.get("num_threads") is None:
        options["num_threads"] = max(1, len(os.sched_getaffinity(0)) // config.replicas)
    trace = f"{config.trace_file}.{index}" if config.trace_file else None
    return dataclasses.replace(config, host="127.0.0.1", port=port, replicas=1, upstreams=(),
                               engine_options=tuple(options.items()), trace_file=trace)


def _banner(message: str) -> None:
    print(f"fastgen: {message}", file=sys.stderr, flush=True)


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything is loaded: a port in use fails here, at once.
    Raises :class:`PortInUseError`."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PortInUseError(f"cannot listen on {host}:{port}: unknown host ({e})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is free
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        why = "the address is already in use (another server?); pick another --port" \
            if e.errno == errno.EADDRINUSE else e.strerror
        raise PortInUseError(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


class PortInUseError(OSError):
    pass


class _Server:
    """uvicorn's server, made lazily (uvicorn is imported only to serve)."""

    @staticmethod
    def make(config, drain=None, drain_timeout_s: float = 30.0):
        """``drain(timeout_s)``: the app's coroutine that finishes or cuts what is in flight once
        the listening socket is closed, before uvicorn's own shutdown (which then has nothing left
        to cancel, so no "timeout graceful shutdown exceeded" traceback)."""
        import uvicorn

        class Server(uvicorn.Server):
            async def shutdown(self, sockets=None):
                for server in self.servers:
                    server.close()
                for sock in sockets or []:
                    sock.close()
                if drain is not None and not self.force_exit:
                    try:
                        await drain(drain_timeout_s)
                    except Exception:  # a drain that fails must not stop the shutdown
                        logging.getLogger(__name__).exception("draining failed")
                await super().shutdown(sockets=None)

            @contextlib.contextmanager
            def capture_signals(self):
                # As uvicorn's, without re-raising the signal after shutdown: a server that
                # drained on SIGTERM exits with 0, not -SIGTERM.
                previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

        return Server(config)


def run_server(config: ServerConfig) -> int:
    """Serve until SIGINT or SIGTERM (which drains in-flight requests for up to
    ``drain_timeout_s``). Returns the exit code: 1 when the engine failed to load or died."""
    import uvicorn

    url = f"http://{config.host}:{config.port}"
    try:
        listener = bind_listener(config.host, config.port)
    except PortInUseError as e:
        _banner(f"error: {e}")
        return 2
    if config.balanced:
        from .balancer import Balancer, Upstream, create_balancer_app

        if config.upstreams:
            upstreams = [Upstream(u.rstrip("/")) for u in config.upstreams]
        else:
            ports = [free_port() for _ in range(config.replicas)]
            upstreams = [Upstream(f"http://127.0.0.1:{p}", port=p) for p in ports]
        balancer = Balancer(upstreams, lambda port: spawn_server(replica_config(config, port, ports.index(port))),
                            drain_timeout_s=config.drain_timeout_s)
        app = create_balancer_app(config, balancer)
        _banner(f"balancing over {len(upstreams)} upstream(s) at {url}: {', '.join(u.url for u in upstreams)}")
        engine_loop = None
    else:
        from .app import create_app

        app = create_app(config)
        served = app.state.server
        engine_loop = served.loop
        _banner(f"loading {app.state.server.model_name}; serving at {url} (/health is 503 until ready)")

    # uvicorn's own graceful timeout only backs up the app's drain (which waits drain_timeout_s itself)
    server = _Server.make(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                         timeout_graceful_shutdown=10.0, access_log=False),
                          drain=getattr(app.state, "drain", None), drain_timeout_s=config.drain_timeout_s)
    if engine_loop is not None:
        def watch_engine() -> None:
            announced = False
            while not server.should_exit:
                if engine_loop.state == "ready" and not announced:
                    defaults = served.facts.generation_defaults
                    if defaults is not None:
                        _banner(f"sampling defaults for requests that give none: {defaults.describe()}")
                    _banner(f"ready at {url} (dashboard: {url}/dashboard)")
                    announced = True
                if engine_loop.state == "failed":
                    _banner(f"the engine failed: {engine_loop.error}; shutting down")
                    server.should_exit = True
                time.sleep(0.1)

        threading.Thread(target=watch_engine, name="fastgen-engine-watch", daemon=True).start()
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()
    if engine_loop is not None and engine_loop.state == "failed":
        return 1
    return 0 if server.started else 1


def serve(model: str | None = None, *, replicas: int = 1, host: str = "127.0.0.1", port: int | None = None,
          api_key: str | None = None, served_model_name: str | None = None, max_queue: int | None = None,
          request_timeout_s: float | None = None, upstreams: tuple[str, ...] = (),
          startup_timeout_s: float = 600.0, **engine_options: Any):
    """Start ``fastgen serve`` in a background process and return a :class:`fastgen.client.Client`
    once ``/health`` answers 200. ``client.terminate()`` stops the server.

    ``engine_options`` are those of ``fastgen.pipeline`` (``dtype``, ``budget_tokens``, ...);
    ``port=None`` picks a free one.
    """
    from ..client import Client
    from .config import DEFAULT_MAX_QUEUE

    config = ServerConfig(model=model, host=host, port=free_port(host) if port is None else port,
                          served_model_name=served_model_name, api_keys=(api_key,) if api_key else (),
                          max_queue=DEFAULT_MAX_QUEUE if max_queue is None else max_queue,
                          request_timeout_s=request_timeout_s, replicas=replicas, upstreams=tuple(upstreams),
                          engine_options=tuple(engine_options.items()))
    config.model_name()  # a missing model fails here, not in the child
    proc = spawn_server(config, new_session=True)
    client = Client(f"http://{host}:{config.port}", api_key=api_key, process=proc)
    try:
        client.wait_ready(startup_timeout_s)
    except BaseException:
        client.terminate()
        raise
    return client

