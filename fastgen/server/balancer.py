"""A load-aware balancer over ``fastgen serve`` instances: local replicas it starts and
restarts, or ``--upstream`` servers elsewhere.

Routing: each request goes to the healthy upstream with the least outstanding work, the
tokens (estimated prompt + requested new tokens, times choices) of the requests the
balancer has sent there and not seen finish. Not round-robin: a replica busy with long
generations gets fewer new ones.

Faults: an upstream that refuses a connection, fails before answering, answers 503
(loading, failed) or 429 (queue full) has not started the request, so it goes to the next
one. A request whose upstream dies mid-response fails with a clear error (an SSE error event,
or a 502). Every ``health_interval_s`` each upstream's ``/health`` is polled; a local replica
that exited or stopped answering is restarted.
"""
from __future__ import annotations

import asyncio
import enum
import json
import logging
import subprocess
import weakref
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .http import CONTENT_TYPE, create_fastapi_app, race_disconnect, sse
from .config import ServerConfig
from .errors import APIError
from .health import probe_async
from .openapi import route_doc

log = logging.getLogger(__name__)

_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host",
                          "upgrade", "te", "trailer", "proxy-authorization", "proxy-connection"})
_DEFAULT_NEW_TOKENS = {"/v1/completions": 16}
_FALLBACK_NEW_TOKENS = 256


def estimate_tokens(path: str, body: dict) -> int:
    """Outstanding work of one request: (prompt tokens ~ characters / 4, plus the new tokens it
    may generate) for each prompt and choice."""
    prompt = body.get("prompt", body.get("messages", body.get("prompts", "")))
    num_prompts = 1
    if path == "/v1/completions" and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        num_prompts = len(prompt)
    elif path == "/generate" and isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) \
            and not (isinstance(prompt[0], list) and prompt[0] and isinstance(prompt[0][0], int)):
        num_prompts = len(prompt)
    prompt_tokens = len(json.dumps(prompt)) // 4 // num_prompts + 1
    new_tokens = (body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_new_tokens")
                  or _DEFAULT_NEW_TOKENS.get(path, _FALLBACK_NEW_TOKENS))
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    if not isinstance(new_tokens, int):
        new_tokens = _FALLBACK_NEW_TOKENS
    return max(1, (prompt_tokens + new_tokens) * max(1, n) * num_prompts)


class UpstreamState(str, enum.Enum):
    STARTING = "starting"   # a local replica loading its model (or an upstream not yet checked)
    UP = "up"
    DOWN = "down"

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class Upstream:
    """One server behind the balancer, and what the balancer knows of it."""

    url: str
    port: int | None = None                 # set for a local replica (restartable)
    process: subprocess.Popen | None = None
    state: UpstreamState = UpstreamState.STARTING
    outstanding_tokens: int = 0
    in_flight: int = 0
    num_routed: int = 0
    num_failed_health: int = 0
    num_restarts: int = 0
    last_error: str | None = None

    def describe(self) -> dict:
        return {"url": self.url, "state": self.state.value, "pid": None if self.process is None else self.process.pid,
                "outstanding_tokens": self.outstanding_tokens, "in_flight": self.in_flight,
                "num_routed": self.num_routed, "num_restarts": self.num_restarts, "last_error": self.last_error}


class _UpstreamCollector:
    def __init__(self, balancer: "Balancer") -> None:
        self._balancer = balancer

    def collect(self):
        families = {
            "up": GaugeMetricFamily("fastgen_balancer_upstream_up", "1 when the upstream is healthy", labels=["upstream"]),
            "tokens": GaugeMetricFamily("fastgen_balancer_outstanding_tokens", "estimated tokens of work sent "
                                        "to the upstream and not finished", labels=["upstream"]),
            "in_flight": GaugeMetricFamily("fastgen_balancer_in_flight", "requests being proxied",
                                           labels=["upstream"]),
            "restarts": GaugeMetricFamily("fastgen_balancer_restarts", "times the replica was restarted",
                                          labels=["upstream"]),
        }
        for u in self._balancer.upstreams:
            families["up"].add_metric([u.url], float(u.state is UpstreamState.UP))
            families["tokens"].add_metric([u.url], u.outstanding_tokens)
            families["in_flight"].add_metric([u.url], u.in_flight)
            families["restarts"].add_metric([u.url], u.num_restarts)
        yield from families.values()


class Balancer:
    """Routes requests over ``upstreams``; ``spawn(port)`` (re)starts a local replica."""

    def __init__(self, upstreams: list[Upstream], spawn: Callable[[int], subprocess.Popen] | None = None, *,
                 health_interval_s: float = 1.0, max_failed_health: int = 3, drain_timeout_s: float = 30.0) -> None:
        self.upstreams = upstreams
        self._spawn = spawn
        self._health_interval_s = health_interval_s
        self._max_failed_health = max_failed_health
        self._drain_timeout_s = drain_timeout_s
        self._client: httpx.AsyncClient | None = None
        self._monitor: asyncio.Task | None = None
        self.registry = CollectorRegistry()
        self.requests = Counter("fastgen_balancer_requests", "requests routed, by upstream", ["upstream"],
                                registry=self.registry)
        self.retries = Counter("fastgen_balancer_retries", "requests moved to another upstream before starting",
                               registry=self.registry)
        self.failed_in_flight = Counter("fastgen_balancer_failed_in_flight",
                                        "requests whose upstream failed mid-response", registry=self.registry)
        self.registry.register(_UpstreamCollector(self))

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        for u in self.upstreams:
            if u.port is not None and self._spawn is not None:
                u.process = self._spawn(u.port)
        self._monitor = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        procs = [u.process for u in self.upstreams if u.process is not None and u.process.poll() is None]
        for p in procs:
            p.terminate()  # SIGTERM: each replica drains what it still has
        for p in procs:
            try:
                await asyncio.to_thread(p.wait, self._drain_timeout_s + 5)
            except subprocess.TimeoutExpired:
                p.kill()
                await asyncio.to_thread(p.wait)
        if self._client is not None:
            await self._client.aclose()

    async def drain(self, timeout_s: float) -> None:
        """On SIGTERM: each local replica drains (and cuts, with final chunks) its own requests;
        the relays here end as their upstream streams do."""
        in_flight = sum(u.in_flight for u in self.upstreams)
        log.warning("shutting down: %d request(s) in flight; replicas drain for up to %g s", in_flight, timeout_s)
        for u in self.upstreams:
            if u.process is not None and u.process.poll() is None:
                u.process.terminate()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s + 8.0
        while sum(u.in_flight for u in self.upstreams) and loop.time() < deadline:
            await asyncio.sleep(0.05)

    @property
    def healthy(self) -> list[Upstream]:
        return [u for u in self.upstreams if u.state is UpstreamState.UP]

    # -- routing ----------------------------------------------------------------------------------

    def pick(self, exclude: set[Upstream]) -> Upstream | None:
        candidates = [u for u in self.healthy if u not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda u: (u.outstanding_tokens, u.in_flight, u.num_routed))

    async def proxy(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}  # the upstream answers the 400
        body = body if isinstance(body, dict) else {}
        path = request.url.path
        cost = estimate_tokens(path, body) if request.method == "POST" else 0
        streaming = body.get("stream") is True
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        tried: set[Upstream] = set()
        refusal: Response | None = None
        while (u := self.pick(tried)) is not None:
            tried.add(u)
            if len(tried) > 1:
                self.retries.inc()
            url = u.url + path + (f"?{request.url.query}" if request.url.query else "")
            u.outstanding_tokens += cost
            u.in_flight += 1
            u.num_routed += 1
            self.requests.labels(u.url).inc()
            released = False

            def release(u: Upstream = u) -> None:
                nonlocal released
                if not released:
                    released = True
                    u.outstanding_tokens -= cost
                    u.in_flight -= 1

            try:
                upstream_req = self._client.build_request(request.method, url, headers=headers, content=raw)
                resp = await self._client.send(upstream_req, stream=True)
            except httpx.TransportError as e:  # nothing was generated for the client: try another
                release()
                self._mark_down(u, f"{type(e).__name__}: {e}")
                continue
            except BaseException:
                release()
                raise
            if resp.status_code in (429, 503):  # full or not serving: this request has not started
                content = await resp.aread()
                await resp.aclose()
                release()
                refusal = Response(content, status_code=resp.status_code, headers=_response_headers(resp))
                continue
            if streaming and resp.headers.get("content-type", "").startswith("text/event-stream"):
                relay = self._relay(u, resp, release)
                weakref.finalize(relay, release)  # a relay never started (client gone) still releases
                return StreamingResponse(relay, status_code=resp.status_code, headers=_response_headers(resp))
            try:
                content = await race_disconnect(request, resp.aread())
            except httpx.TransportError as e:
                self.failed_in_flight.inc()
                self._mark_down(u, f"{type(e).__name__}: {e}")
                raise APIError(502, f"upstream {u.url} failed while answering this request ({e}); "
                                    "it was not completed", type="server_error", code="upstream_failed") from None
            finally:
                await resp.aclose()
                release()
            return Response(content, status_code=resp.status_code, headers=_response_headers(resp))
        if refusal is not None:
            return refusal
        raise APIError(503, "no healthy upstream to serve this request", type="server_error",
                       code="no_upstream", headers={"Retry-After": "1"})

    async def _relay(self, u: Upstream, resp: httpx.Response, release: Callable[[], None]) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.TransportError as e:
            self.failed_in_flight.inc()
            self._mark_down(u, f"{type(e).__name__}: {e}")
            yield sse(APIError(502, f"upstream {u.url} failed mid-stream ({type(e).__name__}); the response is "
                                    "incomplete", type="server_error", code="upstream_failed").body()).encode()
        finally:
            await resp.aclose()
            release()

    def _mark_down(self, u: Upstream, reason: str) -> None:
        if u.state is not UpstreamState.DOWN:
            log.warning("upstream %s is down: %s", u.url, reason)
        u.state = UpstreamState.DOWN
        u.last_error = reason

    # -- health -----------------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._check(u) for u in self.upstreams))
            await asyncio.sleep(self._health_interval_s)

    async def _check(self, u: Upstream) -> None:
        if u.process is not None and u.process.poll() is not None:
            self._mark_down(u, f"replica process exited with code {u.process.returncode}")
            await self._restart(u)
            return
        answer = await probe_async(self._client, u.url, timeout_s=max(1.0, self._health_interval_s * 2))
        status = answer.state if answer.status_code is not None else answer.detail.split(":")[0]
        if answer.ok:
            if u.state is not UpstreamState.UP:
                log.info("upstream %s is up", u.url)
            u.state = UpstreamState.UP
            u.num_failed_health = 0
            return
        if status == "loading" and u.state is UpstreamState.STARTING:
            return  # still loading its model
        u.num_failed_health += 1
        if u.state is UpstreamState.UP and u.num_failed_health >= self._max_failed_health or status == "failed":
            self._mark_down(u, f"health check failed ({status})")
        if u.state is UpstreamState.DOWN and u.process is not None and (
                status == "failed" or u.num_failed_health >= self._max_failed_health):
            await self._restart(u)

    async def _restart(self, u: Upstream) -> None:
        if self._spawn is None or u.port is None:
            return
        if u.process is not None and u.process.poll() is None:
            u.process.kill()
            await asyncio.to_thread(u.process.wait)
        log.warning("restarting replica %s", u.url)
        u.process = self._spawn(u.port)
        u.state = UpstreamState.STARTING
        u.num_failed_health = 0
        u.num_restarts += 1


def _response_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS | {"content-encoding"}}


def create_balancer_app(config: ServerConfig, balancer: Balancer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await balancer.start()
        try:
            yield
        finally:
            await balancer.close()

    app = create_fastapi_app("fastgen balancer", lifespan, config)
    app.state.balancer = balancer
    app.state.drain = balancer.drain

    @app.get("/dashboard", include_in_schema=False)  # a page and its feed, not API
    async def dashboard() -> Response:
        from importlib import resources

        page = resources.files("fastgen.server").joinpath("static/dashboard.html").read_text(encoding="utf-8")
        return Response(page, media_type="text/html; charset=utf-8")

    @app.get("/dashboard/feed", include_in_schema=False)
    async def dashboard_feed(request: Request) -> Response:
        """Replica ``?replica=I``'s feed, relayed, after a line that lists the replicas."""
        try:
            index = int(request.query_params.get("replica", "0"))
            u = balancer.upstreams[index]
        except (ValueError, IndexError):
            raise APIError(400, f"replica must be an index in [0, {len(balancer.upstreams)})", param="replica") from None
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            resp = await balancer._client.send(balancer._client.build_request(
                "GET", u.url + "/dashboard/feed", headers=headers), stream=True)
        except httpx.TransportError as e:
            raise APIError(502, f"replica {index} ({u.url}) is not answering: {type(e).__name__}",
                           type="server_error", code="upstream_failed") from None

        async def relay() -> AsyncIterator[bytes]:
            yield sse({"kind": "replicas", "replica": index,
                       "replicas": [{"url": x.url, "state": x.state.value} for x in balancer.upstreams]}).encode()
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.TransportError:
                yield sse({"kind": "gone", "replica": index}).encode()
            finally:
                await resp.aclose()

        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            return Response(content, status_code=resp.status_code, headers=_response_headers(resp))
        return StreamingResponse(relay(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/health", **route_doc("/health"))
    async def health() -> JSONResponse:
        up = len(balancer.healthy)
        body = {"status": "ok" if up else "unavailable", "upstreams_up": up, "upstreams": len(balancer.upstreams)}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics", **route_doc("/metrics"))
    async def metrics() -> Response:
        return Response(generate_latest(balancer.registry), media_type=CONTENT_TYPE)

    @app.get("/replicas", summary="the balancer's replicas and what it knows of each", response_model=None)
    async def replicas() -> JSONResponse:
        return JSONResponse({"upstreams": [u.describe() for u in balancer.upstreams]})

    for path, methods in (("/v1/completions", ["POST"]), ("/v1/chat/completions", ["POST"]),
                          ("/generate", ["POST"]), ("/tokenize", ["POST"]), ("/detokenize", ["POST"]),
                          ("/v1/models", ["GET"])):
        app.add_api_route(path, balancer.proxy, methods=methods, **route_doc(path))  # the replicas' schema
    return app
