"""The HTTP app of one engine: OpenAI's completions and chat, fastgen's native ``/generate``,
tokenize/detokenize, models, health and metrics.

Handlers run on the event loop and never touch the engine: they read its immutable
:class:`~fastgen.server.facts.EngineFacts` (built once, when it has loaded), validate, tokenize
(in a worker thread), submit to the :class:`EngineLoop`, and turn its deltas into JSON or
server-sent events. A client that goes away aborts its engine requests. The two OpenAI
endpoints are two classes in openai_routes.py; their bodies are in responses.py.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from ..engine import Engine
from ..errors import EngineDeadError, InvalidRequestError
from ..pipeline import apply_chat_template
from ..request import SamplingParams
from .config import ServerConfig
from .dashboard import Telemetry, dashboard_html
from .engine_loop import Delta, EngineLoop, LoopState, StepReport, Stream
from .errors import APIError, QueueFullError, bad_request, from_invalid_request, renamed
from .facts import EngineFacts
from .http import M, create_fastapi_app, event_stream, parse_body, race_disconnect, request_tenant, sse
from .metrics import CONTENT_TYPE, ServerMetrics
from .openai_routes import SSE_DONE, Chat, Completions, answer, shutdown_event
from .openapi import route_doc
from .protocol import DetokenizeRequest, GenerateRequest, TokenizeRequest, model_not_found
from .tools import ToolPlan, with_tools
from .wire import response_to_json

log = logging.getLogger(__name__)

COMPLETIONS, CHAT = Completions(), Chat()   # the two OpenAI endpoints (openai_routes.py)


class Server:
    """State shared by the handlers of one app."""

    def __init__(self, config: ServerConfig, load: Callable[[], Engine]) -> None:
        self.config = config
        self.model_name = config.model_name()
        self._facts: EngineFacts | None = None

        def load_engine() -> Engine:  # on the engine thread, before the loop says ready
            engine = load()
            self._facts = EngineFacts.of(engine, self.model_name)
            return engine

        self.loop = EngineLoop(load_engine, max_queue=config.max_queue)
        self.metrics = ServerMetrics(self.loop)
        self.telemetry = Telemetry({"model": self.model_name}, config.trace_file)
        self.loop.on_step = self._on_step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastgen-tokenize")

    def _on_step(self, report: StepReport) -> None:
        self.metrics.on_step(report)
        self.telemetry.feed(report.records)

    # -- engine facts (immutable once loaded) ----------------------------------------------------

    @property
    def facts(self) -> EngineFacts:
        """The loaded engine's facts; a 503 while it is loading, failed or stopped."""
        if self.loop.state is not LoopState.READY or self._facts is None:
            raise APIError(503, f"the engine is {self.loop.state}", type="server_error", code="engine_unavailable")
        return self._facts

    def check_context(self, prompt_tokens: int, max_tokens: int, param: str) -> None:
        """400 when the prompt plus an explicit ``max_tokens`` exceed the context (as OpenAI and
        vLLM answer), rather than cutting the answer short silently."""
        context = self.facts.max_model_len
        if prompt_tokens + max_tokens > context:
            raise APIError(400, f"this model's maximum context length is {context} tokens, but {prompt_tokens + max_tokens} "
                                f"were requested ({prompt_tokens} in the prompt, {max_tokens} in {param}); "
                                f"shorten the prompt or lower {param}", param=param, code="context_length_exceeded")

    def with_model_defaults(self, req: M) -> M:
        """``req`` with the model's own sampling defaults (generation_defaults.py) in the fields it
        left out; the request's values always win."""
        defaults = self.facts.generation_defaults
        if defaults is None:
            return req
        missing = {k: v for k, v in defaults.as_dict().items() if getattr(req, k, 0) is None}
        return req.model_copy(update=missing) if missing else req

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise model_not_found(name, self.model_name)

    @lru_cache(maxsize=65536)
    def token_text(self, token_id: int) -> str:
        return self.facts.tokenizer.decode([token_id])

    # -- tokenization, off the engine thread -------------------------------------------------------

    async def _off_thread(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.facts.tokenizer.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def _template(self, messages: list[dict], tools: ToolPlan | None = None) -> str:
        """The model's chat template applied to ``messages`` (and the tools the model may call);
        a 400 naming ``messages`` if it cannot be."""
        tokenizer = self.facts.tokenizer
        template_tools = None
        if tools is not None:
            messages, template_tools = with_tools(messages, tools, tokenizer.chat_template)
        try:
            return apply_chat_template(tokenizer, messages, template_tools)
        except InvalidRequestError as e:
            raise from_invalid_request(e) from None
        except Exception as e:  # a template that rejects these messages (e.g. the roles' order)
            raise bad_request(f"messages: the chat template failed: {e}", "messages") from None

    def check_prompt_size(self, num_chars: int, param: str, num_messages: int = 0) -> None:
        """A quick 400 for a prompt that cannot fit, before the one tokenizer thread spends seconds
        on it while every other request waits (a 10 MB prompt took 28 s). A chat of more messages
        than the context has tokens cannot fit either: a template writes at least one per message."""
        facts = self.facts
        context = facts.max_model_len
        if num_chars > facts.max_prompt_chars or num_messages > context:
            what = f"{num_messages} messages" if num_messages > context else f"{num_chars} characters"
            raise APIError(400, f"{param}: {what} cannot fit in this model's maximum context length of {context} "
                                f"tokens; shorten the prompt", param=param, code="context_length_exceeded")

    async def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self.check_prompt_size(len(prompt), "prompt")
            return await self._off_thread(self._encode, prompt)
        return list(prompt)

    async def encode_chat(self, messages: list[dict], tools: ToolPlan | None = None) -> list[int]:
        self.check_prompt_size(_num_chars(messages), "messages", len(messages))
        return await self._off_thread(lambda: self._encode(self._template(messages, tools)))

    async def check_constraint(self, params: SamplingParams, param_names: dict[str, str]) -> None:
        """Compile the output constraint now (off the engine thread): a grammar that does not compile
        is a 400 here, and the engine's own compile finds it in the compiler's cache."""
        spec = params.structured
        if spec is None:
            return
        try:
            await asyncio.to_thread(self.facts.compile_grammar, spec)
        except InvalidRequestError as e:
            raise from_invalid_request(e, param_names) from None

    # -- submission ---------------------------------------------------------------------------------

    async def submit(self, request: Request, prompts: list[list[int]], params: list[SamplingParams],
                     timeout_s: float | None, param_names: dict[str, str], streamed: bool,
                     cache_salt: str | None = None) -> Stream:
        """Queue the prompts under the API key's tenant (prefix-cache partition) and ``cache_salt``."""
        try:
            return await self.loop.submit(prompts, params, timeout_s or self.config.request_timeout_s,
                                          quiet=not streamed, tenant=request_tenant(request),
                                          cache_salt=cache_salt)
        except InvalidRequestError as e:
            raise from_invalid_request(e, param_names) from None
        except QueueFullError as e:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, f"the server is busy: {e}; retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None

    async def collect(self, request: Request, stream: Stream) -> dict[int, Delta]:
        """Wait for every choice's final delta; abort them if the client disconnects first."""
        async def drain() -> dict[int, Delta]:
            return {d.index: d async for d in stream if d.finish_reason is not None}

        try:
            return await race_disconnect(request, drain())
        finally:
            stream.close()

    # -- fastgen's native endpoint (the Python client's) -----------------------------------------

    async def generate(self, request: Request) -> Response:
        """``{"prompts": ..., "stream": false, "request_timeout_s": null, **generate_kwargs}``.

        Prompts and kwargs mean what they mean to the pipeline (MII's names and defaults).
        Answers ``{"responses": [Response...]}``, or for ``stream: true`` (one prompt) events
        ``{"text": delta}`` then ``{"response": Response}`` and ``[DONE]``.
        """
        req = await parse_body(request, GenerateRequest)
        self.check_model(req.model)
        try:
            params = req.sampling_params()
        except (InvalidRequestError, TypeError) as e:
            raise bad_request(str(e), getattr(e, "param", None)) from None
        await self.check_constraint(params, {})
        try:
            prompt_ids = [await (self.encode_chat(p) if p and isinstance(p[0], dict) else self.encode(p))
                          for p in req.prompt_list()]
        except APIError as e:  # the errors of a prompt or a chat name their OpenAI field
            raise renamed(e, {"prompt": "prompts", "messages": "prompts"}) from None
        stream = await self.submit(request, prompt_ids, [params] * len(prompt_ids), req.request_timeout_s,
                                   {"prompt": "prompts"}, req.stream, req.cache_salt)
        if req.stream:
            return event_stream(self._native_sse(stream), stream.close)
        finals = await self.collect(request, stream)
        out = []
        for i in range(len(finals)):
            d = finals[i]
            if d.response is None:
                raise APIError(500, "the engine failed", type="server_error")
            out.append(response_to_json(d.response))
        return JSONResponse({"responses": out})

    async def _native_sse(self, stream: Stream) -> AsyncIterator[str]:
        try:
            async for d in stream:
                if d.text:
                    yield sse({"text": d.text})
                if d.finish_reason is not None:
                    if d.response is None:
                        yield sse(APIError(500, "the engine failed", type="server_error").body())
                    else:
                        yield sse({"response": response_to_json(d.response)})
                    if d.error is not None:
                        yield shutdown_event(d)
            yield SSE_DONE
        finally:
            stream.close()

    # -- small endpoints ----------------------------------------------------------------------------

    async def tokenize(self, request: Request) -> dict:
        req = await parse_body(request, TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            messages = [m.as_template_dict() for m in req.messages]
            self.check_prompt_size(_num_chars(messages), "messages", len(messages))
            text = await self._off_thread(self._template, messages)
        else:
            text = req.prompt
            self.check_prompt_size(len(text), "prompt")
        ids = await self._off_thread(self._encode, text, req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.facts.max_model_len}

    async def detokenize(self, request: Request) -> dict:
        req = await parse_body(request, DetokenizeRequest)
        self.check_model(req.model)
        vocab = self.facts.vocab_size
        if not all(0 <= t < vocab for t in req.tokens):
            raise bad_request(f"tokens must be integers in [0, {vocab})", "tokens")
        text = await self._off_thread(self.facts.tokenizer.decode, req.tokens)
        return {"prompt": text}

    def health(self) -> JSONResponse:
        state = self.loop.state
        if state is LoopState.READY:
            return JSONResponse({"status": "ok"})
        body = {"status": state.value}
        if self.loop.error is not None:
            body["error"] = f"{type(self.loop.error).__name__}: {self.loop.error}"
        return JSONResponse(body, status_code=503)

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "fastgen"}
        if self.loop.state is LoopState.READY:
            card["max_model_len"] = self.facts.max_model_len
        return {"object": "list", "data": [card]}

    async def drain(self, timeout_s: float) -> None:
        """On SIGTERM, after the listening socket closed: let requests in flight finish for up to
        ``timeout_s``, then cut what is left (each stream gets a final chunk, an error event and
        ``[DONE]``), and wait for those answers to be written."""
        n = self.loop.num_in_flight
        if not n:
            _say("shutting down: no requests in flight")
            return
        _say(f"shutting down: draining {n} request(s) in flight for up to {timeout_s:g} s")
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.loop.num_in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        left = self.loop.num_in_flight
        if not left:
            _say(f"drained: all {n} request(s) finished")
            return
        _say(f"drain timeout ({timeout_s:g} s): cutting {left} request(s) still running "
             f"({n - left} finished); they end with finish_reason 'abort' and an error event")
        self.loop.cut(f"the server is shutting down: this request was cut after the {timeout_s:g} s drain timeout")
        end = asyncio.get_running_loop().time() + 5.0
        while self.loop.num_in_flight and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # let the final chunks reach the sockets

    def close(self) -> None:
        self.loop.stop()
        self.telemetry.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _num_chars(messages: list[dict]) -> int:
    return sum(len(m.get("content") or "") for m in messages)


def _say(message: str) -> None:
    import sys

    print(f"fastgen: {message}", file=sys.stderr, flush=True)


def create_app(config: ServerConfig, load: Callable[[], Engine] | None = None, *,
               wait_loaded: bool = False) -> FastAPI:
    """The app of one engine. ``load`` builds the engine (default: ``config.model`` with its options);
    it runs on the engine thread after the app starts, and ``/health`` answers 503 until it is done.
    With ``wait_loaded`` the app's startup itself waits for the engine and fails if it does not
    load (for hosts such as Ray Serve that send traffic to an app as soon as it has started)."""
    if load is None:
        def load() -> Engine:
            return Engine.from_pretrained(config.model, **config.engine_kwargs)

    server = Server(config, load)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start(asyncio.get_running_loop())
        try:
            if wait_loaded:
                await server.loop.wait_loaded()
            yield
        finally:
            server.close()

    app = create_fastapi_app("fastgen", lifespan, config)
    app.state.server = server
    app.state.drain = server.drain

    @app.post("/v1/completions", **route_doc("/v1/completions"))
    async def completions(request: Request) -> Response:
        return await answer(server, request, COMPLETIONS)

    @app.post("/v1/chat/completions", **route_doc("/v1/chat/completions"))
    async def chat_completions(request: Request) -> Response:
        return await answer(server, request, CHAT)

    app.add_api_route("/generate", server.generate, methods=["POST"], **route_doc("/generate"))
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"], **route_doc("/tokenize"))
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"], **route_doc("/detokenize"))
    app.add_api_route("/v1/models", server.models, methods=["GET"], **route_doc("/v1/models"))
    app.add_api_route("/health", server.health, methods=["GET"], **route_doc("/health"))

    @app.get("/metrics", **route_doc("/metrics"))
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/dashboard", include_in_schema=False)  # a page and its feed, not API
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(dashboard_html())

    @app.get("/dashboard/feed", include_in_schema=False)
    async def dashboard_feed() -> StreamingResponse:
        if server.loop.state is LoopState.READY:
            server.telemetry.info.update(server.facts.dashboard_info())
        return StreamingResponse(server.telemetry.subscribe(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return app
