"""The server's own configuration (the engine's stays in :mod:`fastgen.config`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..config import EngineOptions
from ..errors import InvalidRequestError

DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 256


@dataclass(frozen=True)
class ServerConfig:
    """What ``fastgen serve`` was asked for.

    api_keys: clients must send one of these as ``Authorization: Bearer KEY`` (none = open).
        Each key is its own tenant: requests of different keys never share cached prefix
        blocks (docs/server.md, "Prefix caching and tenants").

    max_queue: sequences (prompts x ``n``) that may wait to be scheduled; more are refused
        with 429 and ``Retry-After``.
    request_timeout_s: default deadline of every request, from its arrival (``None`` = none);
        a request may set its own with the ``request_timeout_s`` field.
    drain_timeout_s: on SIGTERM, how long in-flight requests may run before they are cancelled.
    body_timeout_s: a request body must have arrived this long after the server started reading
        it, else 408 (a client that stalls mid-body holds its connection no longer).
    replicas: engine processes behind a load balancer (1 = no balancer).
    upstreams: other ``fastgen serve`` URLs to balance over (no local engine then).
    engine_options: keywords for :class:`fastgen.config.EngineOptions`.
    trace_file: write the engine's step records and request events there as JSON lines
        (with replicas, replica ``i`` writes ``PATH.i``).
    """

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    max_queue: int = DEFAULT_MAX_QUEUE
    request_timeout_s: float | None = None
    drain_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    replicas: int = 1
    upstreams: tuple[str, ...] = ()
    engine_options: tuple[tuple[str, Any], ...] = ()
    log_level: str = "warning"
    trace_file: str | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{param}: {message}", param=param)

        check(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        check(all(isinstance(k, str) and k and k == k.strip() and "\n" not in k for k in self.api_keys),
              "api_key", "each API key must be a non-empty string without surrounding whitespace or newlines")
        check(self.max_queue >= 1, "max_queue", f"must be >= 1, got {self.max_queue}")
        check(self.request_timeout_s is None or self.request_timeout_s > 0, "request_timeout_s",
              f"must be > 0, got {self.request_timeout_s}")
        check(self.drain_timeout_s >= 0, "drain_timeout_s", f"must be >= 0, got {self.drain_timeout_s}")
        check(self.body_timeout_s > 0, "body_timeout_s", f"must be > 0, got {self.body_timeout_s}")
        check(self.replicas >= 1, "replicas", f"must be >= 1, got {self.replicas}")
        check(not (self.upstreams and self.replicas > 1), "upstreams",
              "balance over either local --replicas or --upstream servers, not both")
        check(all(u.startswith(("http://", "https://")) for u in self.upstreams), "upstreams",
              "each upstream must be an http:// or https:// URL")
        EngineOptions.from_kwargs(self.engine_kwargs)  # unknown or bad engine options fail here, before any load

    @property
    def api_key(self) -> str | None:
        """The first API key (``None`` when the server is open); every key is in ``api_keys``."""
        return self.api_keys[0] if self.api_keys else None

    @property
    def engine_kwargs(self) -> dict[str, Any]:
        return dict(self.engine_options)

    @property
    def balanced(self) -> bool:
        return self.replicas > 1 or bool(self.upstreams)

    def model_name(self) -> str:
        """The name clients put in ``model``: ``served_model_name``, else the model file's stem."""
        if self.served_model_name:
            return self.served_model_name
        from ..model.loader import resolve_model_path

        path = resolve_model_path(self.model).rstrip("/")
        name = os.path.basename(path)
        return name[:-len(".gguf")] if name.endswith(".gguf") else name

    def to_argv(self) -> list[str]:
        """``fastgen serve`` arguments that rebuild this config (the API key travels in
        ``FASTGEN_API_KEY``, not on the command line, where other users could read it)."""
        argv = [] if self.model is None else [self.model]
        argv += ["--host", self.host, "--port", str(self.port), "--max-queue", str(self.max_queue),
                 "--drain-timeout-s", str(self.drain_timeout_s), "--body-timeout-s", str(self.body_timeout_s),
                 "--log-level", self.log_level]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        if self.request_timeout_s is not None:
            argv += ["--request-timeout-s", str(self.request_timeout_s)]
        if self.replicas > 1:
            argv += ["--replicas", str(self.replicas)]
        if self.upstreams:
            argv += ["--upstream", *self.upstreams]
        if self.trace_file:
            argv += ["--trace-file", self.trace_file]
        for name, value in self.engine_options:
            flag = name.replace("_", "-")
            if isinstance(value, bool):  # BooleanOptionalAction flags take no value
                argv.append(f"--{flag}" if value else f"--no-{flag}")
            elif value is not None:
                argv += ["--" + flag, str(value)]
        return argv


DEFAULT_MAX_ONGOING_REQUESTS = 64  # the engine's default max_seqs: as many as one step can hold


@dataclass(frozen=True)
class RayConfig:
    """How ``fastgen serve --ray`` places, watches and limits replicas on Ray Serve (the replica
    count is :attr:`ServerConfig.replicas`; docs/server.md, "Replicas on Ray Serve").

    ray_address: the Ray cluster to join (what `ray start --head` printed, or "auto");
        default: start a one-node cluster in this process, ended with the server.
    num_cpus_per_replica: CPUs Ray reserves for each replica; its engine runs that many torch
        threads (at least 1) unless --num-threads says otherwise.
    max_ongoing_requests: requests one replica holds at once; more wait in Serve's proxy
        for the first replica with room.
    max_queued_requests: requests that may wait in the proxy; more are refused with 503
        (-1 = no limit).
    health_check_period_s: how often Serve asks each replica's engine thread whether it is alive.
    health_check_timeout_s: how long an engine may take to answer (at most one step) before its
        replica is replaced.
    """

    ray_address: str | None = None
    num_cpus_per_replica: float = 1.0
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS
    max_queued_requests: int = DEFAULT_MAX_QUEUE
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{param}: {message}", param=param)

        check(self.ray_address is None or bool(self.ray_address.strip()), "ray_address", "must not be empty")
        check(self.num_cpus_per_replica > 0, "num_cpus_per_replica", f"must be > 0, got {self.num_cpus_per_replica}")
        check(self.max_ongoing_requests >= 1, "max_ongoing_requests", f"must be >= 1, got {self.max_ongoing_requests}")
        check(self.max_queued_requests >= 1 or self.max_queued_requests == -1, "max_queued_requests",
              f"must be >= 1, or -1 for no limit, got {self.max_queued_requests}")
        check(self.health_check_period_s > 0, "health_check_period_s", f"must be > 0, got {self.health_check_period_s}")
        check(self.health_check_timeout_s > 0, "health_check_timeout_s",
              f"must be > 0, got {self.health_check_timeout_s}")
