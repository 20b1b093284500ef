"""HTTP pieces shared by the engine app and the balancer: the app factory (error bodies, API
key), the disconnect race and server-sent events. No engine import, so a balancer process
does not load torch.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import weakref
from typing import Any, AsyncIterator, Callable, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ServerConfig

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"   # Prometheus text format of /metrics
from .errors import APIError, from_validation_error
from .openapi import DOCS_PATHS, install_docs

log = logging.getLogger(__name__)

# the dashboard page, the schema and /docs hold no data (the dashboard's feed is keyed)
OPEN_PATHS = frozenset({"/health", "/metrics", "/dashboard", *DOCS_PATHS})
# A request body larger than this is refused (413) before it is read: 8 MiB is 10x the JSON of a
# 128K-token prompt as token ids, and it keeps one client from holding the parser and tokenizer
# for tens of seconds (a 10 MB prompt took 28 s to tokenize here, stalling everyone's requests).
MAX_BODY_BYTES = 8 * 2**20


async def race_disconnect(request: Request, work):
    """``await work`` unless the client disconnects first: then the work is cancelled and the
    request ends with 499 (nginx's "client closed request")."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():  # a cancel takes effect at the task's next step
        raise APIError(499, "client disconnected", code="client_closed")
    return task.result()


def tenant_of(api_key: str) -> str:
    """The prefix-cache tenant of a key: a digest, so the key itself is not kept in the cache's names."""
    return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:32]


def request_tenant(request: Request) -> str | None:
    """The tenant the API key middleware found for this request (``None`` on an open server)."""
    return getattr(request.state, "tenant", None)


class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <key>`` names one of the keys (``OPEN_PATHS`` stay
    open: ``/health``, ``/metrics``, the dashboard's page, the schema and ``/docs``); the key's
    tenant goes into the request's state."""

    def __init__(self, app, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self._keys = [(k.encode(), tenant_of(k)) for k in api_keys]

    def _match(self, token: bytes) -> str | None:
        tenant = None
        for key, t in self._keys:  # compare with every key: the time does not tell which one matched
            if secrets.compare_digest(token, key):
                tenant = t
        return tenant

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            tenant = self._match(token.strip()) if scheme.lower() == b"bearer" else None
            if tenant is None:
                err = APIError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Bounds every request body: over ``MAX_BODY_BYTES`` (declared or sent) is a 413, a body
    that has not all arrived ``timeout_s`` after the handler first asked for it is a 408 (a
    client that stalls mid-body, slowloris-style, then holds its connection no longer). The
    errors are raised inside the handler's ``receive``, so they reach the app's error handler."""

    def __init__(self, app, timeout_s: float, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes", code="request_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        num_bytes = 0
        deadline: float | None = None
        done = False

        async def bounded_receive():
            nonlocal num_bytes, deadline, done
            if done:  # the body is in: later receives wait for a disconnect, unbounded
                return await receive()
            now = asyncio.get_running_loop().time()
            deadline = deadline or now + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - now))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.timeout_s:g} s",
                               code="request_timeout") from None
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_bytes:
                    raise self._too_large()
                done = not message.get("more_body", False)
            return message

        await self.app(scope, bounded_receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Every error, including unknown routes and bugs, answers with an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()


def create_fastapi_app(title: str, lifespan, config: ServerConfig) -> FastAPI:
    """A FastAPI app with OpenAI-style error bodies, the published schema (openapi.py) and,
    when configured, the API key check."""
    from .. import __version__

    app = FastAPI(title=title, version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # openapi.py serves the schema and an offline /docs
    install_error_handlers(app)
    install_docs(app, OPEN_PATHS, keyed=bool(config.api_keys))
    app.add_middleware(BodyLimitMiddleware, timeout_s=config.body_timeout_s)
    if config.api_keys:  # added last, so it runs first: no body is read for a request without the key
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys)
    return app


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


M = TypeVar("M", bound=pydantic.BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    """The body as ``model``; a 400 naming the first field that does not validate."""
    try:
        return model.model_validate_json(await request.body())
    except pydantic.ValidationError as e:
        raise from_validation_error(e) from None


def event_stream(events: AsyncIterator[str], close: Callable[[], None]) -> StreamingResponse:
    """Server-sent events from ``events``, which calls ``close`` when it ends. If the client leaves
    before the body starts, ``events`` never runs; the finalizer still calls ``close`` (aborting
    the engine requests behind it)."""
    weakref.finalize(events, close)
    return StreamingResponse(events, media_type="text/event-stream")
