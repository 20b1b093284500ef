"""fastgen on Ray Serve: a deployment whose every replica owns one engine and serves the app of
:mod:`fastgen.server.app`, the same routes as ``fastgen serve`` (streaming included), behind
Serve's HTTP proxy.

    client --HTTP--> Serve proxy --(power of two choices: fewer ongoing requests)--> replica i
                     (max_queued_requests wait here, more: 503)                     create_app(config)
                                                                                    EngineLoop -> Engine

Serve places each replica on a node with ``num_cpus_per_replica`` free CPUs (its engine runs that
many torch threads), calls :meth:`FastgenReplica.check_health`, which asks the engine thread
itself, and replaces a replica that fails it or dies. ``fastgen serve --ray`` runs it
(:func:`run_ray`); ``serve run fastgen.server.ray_app:build key=value ...`` and Serve config
files use :func:`build`. Needs the optional extra: ``pip install 'fastgen[ray]'``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import signal
import sys
import threading
import time
import typing
from typing import Any

from ..config import EngineOptions
from ..errors import FastgenError, InvalidRequestError
from .app import create_app
from .config import RayConfig, ServerConfig

try:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica
except ImportError:  # the optional extra is missing
    raise FastgenError("Ray Serve is not installed: pip install 'fastgen[ray]'") from None

APP_NAME = "fastgen"
REPLICA_HEADER = "x-fastgen-replica"  # the Serve replica that answered (its unique id)
NODE_HEADER = "x-fastgen-node"        # the Ray node it runs on


class _ReplicaHeaders:
    """ASGI middleware: every response names the replica and the node that answered it."""

    def __init__(self, app, headers: list[tuple[bytes, bytes]]) -> None:
        self.app = app
        self.headers = headers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *self.headers]}
            await send(message)

        await self.app(scope, receive, send_named)


class SpreadRouter(FIFOMixin, RequestRouter):
    """Power of two choices over every replica: two at random, and Serve sends the request to the
    one holding fewer (it asks each replica its count). Serve's default router tries the replicas
    on the proxy's own node first and reaches the others only once those hold
    ``max_ongoing_requests`` each, which leaves engines on other nodes idle while the proxy's
    node is overloaded: right for cheap requests, wrong for engines bound by their own cores."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]


def replica_threads(config: ServerConfig, num_cpus: float | None) -> ServerConfig:
    """``config`` with ``num_threads`` set to the CPUs Ray gave the replica (floor, at least 1),
    unless the user set it. Without this the engine would take every core of the node, whatever
    Ray reserved (and Ray itself sets ``OMP_NUM_THREADS`` to the reservation)."""
    options = dict(config.engine_options)
    if options.get("num_threads") is None:
        options["num_threads"] = max(1, math.floor(num_cpus or 1))
    return dataclasses.replace(config, engine_options=tuple(options.items()))


@serve.deployment(name="fastgen")
@serve.ingress()
class FastgenReplica:
    """One Serve replica: one engine on its own thread, serving :func:`create_app`'s routes."""

    def __init__(self, config: ServerConfig, health_ping_timeout_s: float = 25.0) -> None:
        context = ray.get_runtime_context()
        self.num_cpus = context.get_assigned_resources().get("CPU")
        self.config = replica_threads(config, self.num_cpus)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_id = context.get_node_id()
        self.health_ping_timeout_s = health_ping_timeout_s
        self.server = None

    def __serve_build_asgi_app__(self):
        # wait_loaded: Serve routes requests to a replica once its app has started
        app = create_app(self.config, wait_loaded=True)
        self.server = app.state.server
        app.add_middleware(_ReplicaHeaders, headers=[(REPLICA_HEADER.encode(), self.replica_id.encode()),
                                                     (NODE_HEADER.encode(), self.node_id.encode())])
        return app

    async def check_health(self) -> None:
        """Serve's health check: a round trip through the engine thread (raises when it failed,
        exited or hangs in a step); Serve replaces the replica when this raises."""
        await self.server.loop.ping(self.health_ping_timeout_s)

    def info(self) -> dict[str, Any]:
        """Where this replica runs and how its engine was set up (for operators and tests)."""
        facts = self.server.facts
        return {"replica": self.replica_id, "node": self.node_id, "pid": os.getpid(),
                "actor_name": ray.get_runtime_context().get_actor_name(), "num_cpus": self.num_cpus,
                "num_threads": facts.num_threads, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "model": self.server.model_name}


def application(config: ServerConfig, ray_config: RayConfig) -> serve.Application:
    """The Serve application of ``config.replicas`` engine replicas."""
    return FastgenReplica.options(
        num_replicas=config.replicas,
        ray_actor_options={"num_cpus": ray_config.num_cpus_per_replica},
        max_ongoing_requests=ray_config.max_ongoing_requests,
        max_queued_requests=ray_config.max_queued_requests,
        health_check_period_s=ray_config.health_check_period_s,
        health_check_timeout_s=ray_config.health_check_timeout_s,
        graceful_shutdown_timeout_s=config.drain_timeout_s,
        request_router_config=RequestRouterConfig(request_router_class=SpreadRouter),
        max_constructor_retry_count=3,  # a model that does not load will not load on the 20th try either
        logging_config={"log_level": config.log_level.upper()},  # as `fastgen serve`: no access log at warning
    ).bind(config, health_ping_timeout_s=0.8 * ray_config.health_check_timeout_s)


# -- `serve run fastgen.server.ray_app:build key=value ...` and Serve config files -----------------

# Builder arguments that mean something else under `serve run`: refused, never ignored.
_NOT_BUILDER_ARGS = {
    "host": "the proxy's address is Serve's: `serve run --host/--port`, or http_options in a config file",
    "port": "the proxy's address is Serve's: `serve run --host/--port`, or http_options in a config file",
    "ray_address": "`serve run --address`, or the cluster `serve deploy` talks to",
    "upstreams": "Serve places the replicas; balancing over other servers is `fastgen serve --upstream`",
}


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_SERVER_FIELDS = {k: v for k, v in _field_types(ServerConfig).items() if k != "engine_options"}
_ENGINE_FIELDS = _field_types(EngineOptions)
_RAY_FIELDS = _field_types(RayConfig)


def _convert(name: str, value: Any, hint: Any) -> Any:
    """A builder argument as its field's type: `serve run` passes strings, a config file YAML values."""
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    optional = type(None) in typing.get_args(hint)
    if typing.get_origin(hint) is tuple:  # api_keys: a list, or one string of comma-separated keys
        return tuple(value.split(",")) if isinstance(value, str) else tuple(value)
    if not isinstance(value, str):
        return value
    if optional and value.lower() == "none":
        return None
    for kind in kinds:
        if kind is bool and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if kind is int:
            try:
                return int(value)
            except ValueError:
                continue
        if kind is float:
            try:
                return float(value)
            except ValueError:
                continue
        if kind is str:
            return value
    expected = " or ".join("'auto'" if k is str else k.__name__ for k in kinds)
    raise InvalidRequestError(f"{name}: expected {expected}, got {value!r}", param=name)


def configs_from_args(args: dict[str, Any]) -> tuple[ServerConfig, RayConfig]:
    """The server's and Ray's configs from builder arguments: the names of `fastgen serve`'s
    flags with underscores (``num_blocks=64`` is ``--num-blocks 64``). Unknown names are refused."""
    server: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    ray_options: dict[str, Any] = {}
    for name, value in args.items():
        if name in _NOT_BUILDER_ARGS:
            raise InvalidRequestError(f"{name}: not a builder argument; {_NOT_BUILDER_ARGS[name]}", param=name)
        for fields, out in ((_SERVER_FIELDS, server), (_ENGINE_FIELDS, engine), (_RAY_FIELDS, ray_options)):
            if name in fields:
                out[name] = _convert(name, value, fields[name])
                break
        else:
            known = sorted((set(_SERVER_FIELDS) | set(_ENGINE_FIELDS) | set(_RAY_FIELDS)) - set(_NOT_BUILDER_ARGS))
            raise InvalidRequestError(f"{name}: unknown argument; known: {', '.join(known)}", param=name)
    config = ServerConfig(**server, engine_options=tuple(engine.items()))
    return config, RayConfig(**ray_options)


def build(args: dict[str, Any]) -> serve.Application:
    """The application builder of ``serve run fastgen.server.ray_app:build model=PATH replicas=2``
    and of a Serve config file's ``import_path: fastgen.server.ray_app:build`` with ``args``."""
    config, ray_config = configs_from_args(dict(args))
    config.model_name()  # a missing model fails here, before any replica starts
    return application(config, ray_config)


# -- `fastgen serve --ray` -------------------------------------------------------------------------

def _say(message: str) -> None:
    print(f"fastgen: {message}", file=sys.stderr, flush=True)


def _proxy_listens(url: str, timeout_s: float) -> bool:
    """Whether Serve's proxy answers at ``url`` within ``timeout_s`` (any status: before an app is
    deployed its ``/-/healthz`` is 503, "route table is not populated yet")."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/-/healthz", timeout=2.0)
            return True
        except httpx.HTTPError:
            time.sleep(0.2)
    return False


def run_ray(config: ServerConfig, ray_config: RayConfig) -> int:
    """Deploy ``config.replicas`` replicas on the Ray cluster at ``ray_config.ray_address`` (or on
    a one-node cluster started here) behind Serve's proxy on ``config.host:config.port``; serve
    until SIGINT or SIGTERM, then delete the application (replicas finish what they hold for up
    to ``drain_timeout_s``). Returns the exit code."""
    if config.upstreams:
        raise FastgenError("--ray places its own replicas; --upstream balances over servers that run elsewhere")
    config.model_name()  # a missing model fails here, before Ray starts
    url = f"http://{config.host}:{config.port}"
    local = ray_config.ray_address is None
    if local:
        from .launch import PortInUseError, bind_listener

        try:  # the proxy binds the port later, in another process: fail now, clearly, if it is taken
            bind_listener(config.host, config.port).close()
        except PortInUseError as e:
            _say(f"error: {e}")
            return 2
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a cluster of our own reports nothing
        ray.init(address="local", include_dashboard=False)  # "local": never join a cluster found on this machine
    else:
        ray.init(address=ray_config.ray_address)
    stop = threading.Event()

    def on_signal(*_) -> None:
        if stop.is_set():  # a second Ctrl-C: stop waiting (e.g. for a deployment that does not come up)
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": config.host, "port": config.port}, proxy_location="HeadOnly",
                    logging_config={"log_level": config.log_level.upper()})
        if not _proxy_listens(url, timeout_s=30.0):
            _say(f"error: Serve's proxy does not answer at {url}: Serve already runs on this cluster with its "
                 f"proxy elsewhere (it keeps its first --host/--port); use that port, or `serve shutdown` first")
            return 1
        _say(f"deploying {config.replicas} replica(s) of {config.model_name()} on Ray "
             f"({ray_config.num_cpus_per_replica:g} CPU each; cluster CPUs: {ray.cluster_resources().get('CPU', 0):g})")
        serve.run(application(config, ray_config), name=APP_NAME, route_prefix="/")
        _say(f"ready at {url} (Ray Serve; each response names its replica in {REPLICA_HEADER})")
        while not stop.wait(0.5):
            pass
        _say(f"shutting down: deleting the application (replicas drain for up to {config.drain_timeout_s:g} s)")
        serve.delete(APP_NAME)
        return 0
    except RuntimeError as e:  # Serve's "deploying failed" (a replica that cannot start)
        _say(f"error: {e}")
        return 1
    finally:
        if local:
            serve.shutdown()
        ray.shutdown()
