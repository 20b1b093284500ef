"""The HTTP app of one engine: OpenAI's completions and chat, fastgen's native ``/generate``,
tokenize/detokenize, models, health and metrics.

Handlers run on the event loop and never touch the engine: they validate, tokenize (in a
worker thread), submit to the :class:`EngineLoop`, and turn its deltas into JSON or
server-sent events. A client that goes away aborts its engine requests.
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import cached_property, lru_cache
from typing import AsyncIterator, Callable, Literal, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from ..engine import Engine
from ..errors import EngineDeadError, InvalidRequestError
from ..pipeline import apply_chat_template
from ..request import SamplingParams, TokenLogprob
from .config import ServerConfig
from .dashboard import Telemetry, dashboard_html
from .engine_loop import Delta, EngineLoop, StepReport, Stream
from .errors import (APIError, QueueFullError, bad_request, from_invalid_request, from_validation_error,
                     renamed)
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (COMPLETION_DEFAULT_MAX_TOKENS, PARAM_NAMES, ChatCompletionRequest, CompletionRequest,
                       DetokenizeRequest, GenerateRequest, ResponseBuilder, TokenizeRequest, model_not_found)
from .http import create_fastapi_app, race_disconnect, request_tenant, sse
from .openapi import route_doc
from .tools import ToolCallStream, ToolPlan, with_tools
from .wire import response_to_json

log = logging.getLogger(__name__)

M = TypeVar("M", bound=pydantic.BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    try:
        return model.model_validate_json(await request.body())
    except pydantic.ValidationError as e:
        raise from_validation_error(e) from None


def event_stream(events: AsyncIterator[str], stream: Stream) -> StreamingResponse:
    """Server-sent events from ``events``, which closes ``stream`` when it ends. If the client
    leaves before the body starts, ``events`` never runs; the finalizer still aborts ``stream``."""
    weakref.finalize(events, stream.close)
    return StreamingResponse(events, media_type="text/event-stream")


SSE_DONE = "data: [DONE]\n\n"


class _StreamUsage:
    """A stream's token counts for its final usage chunk: generated tokens of every choice, the
    prompt (and its cached tokens) once per prompt (choice indices ``0, n, 2n...``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    def add(self, d: Delta) -> None:
        if d.response is None:
            return
        self.completion_tokens += d.response.generated_length
        if d.index % self.n == 0:
            self.prompt_tokens += d.response.prompt_length
            self.cached_tokens += d.response.num_cached_tokens

    def chunk(self, builder: ResponseBuilder) -> str:
        return sse(builder.usage_chunk(self.prompt_tokens, self.completion_tokens, self.cached_tokens))


def _failed_event(d: Delta) -> str:
    """The error event of a choice the engine failed."""
    msg = d.response.error if d.response is not None else "the engine failed"
    return sse(APIError(500, f"generation failed: {msg}", type="server_error").body())


def _shutdown_event(d: Delta) -> str:
    """The error event of a choice the server cut while shutting down."""
    return sse(APIError(503, d.error, type="server_error", code="server_shutdown").body())


class Server:
    """State shared by the handlers of one app."""

    def __init__(self, config: ServerConfig, load: Callable[[], Engine]) -> None:
        self.config = config
        self.model_name = config.model_name()
        self.loop = EngineLoop(load, max_queue=config.max_queue)
        self.metrics = ServerMetrics(self.loop)
        self.telemetry = Telemetry({"model": self.model_name}, config.trace_file)
        self.loop.on_step = self._on_step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastgen-tokenize")

    def _on_step(self, report: StepReport) -> None:
        self.metrics.on_step(report)
        self.telemetry.feed(report.records)

    # -- engine facts (immutable once loaded) ----------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self.loop.state != "ready":
            raise APIError(503, f"the engine is {self.loop.state}", type="server_error", code="engine_unavailable")
        return self.loop.engine

    @property
    def max_total_tokens(self) -> int:
        """Prompt + generated tokens one request can have: the context, or the KV pool if smaller."""
        cfg = self.engine.config
        return min(cfg.max_model_len, cfg.cache.num_blocks * cfg.cache.block_size)

    def check_context(self, prompt_tokens: int, max_tokens: int, param: str) -> None:
        """400 when the prompt plus an explicit ``max_tokens`` exceed the context (as OpenAI and
        vLLM answer), rather than cutting the answer short silently."""
        context = self.engine.config.max_model_len
        if prompt_tokens + max_tokens > context:
            raise APIError(400, f"this model's maximum context length is {context} tokens, but {prompt_tokens + max_tokens} "
                                f"were requested ({prompt_tokens} in the prompt, {max_tokens} in {param}); "
                                f"shorten the prompt or lower {param}", param=param, code="context_length_exceeded")

    def with_model_defaults(self, req: M) -> M:
        """``req`` with the model's own sampling defaults (generation_defaults.py) in the fields it
        left out; the request's values always win."""
        defaults = self.engine.generation_defaults
        if defaults is None:
            return req
        missing = {k: v for k, v in defaults.as_dict().items() if getattr(req, k, 0) is None}
        return req.model_copy(update=missing) if missing else req

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise model_not_found(name, self.model_name)

    @lru_cache(maxsize=65536)
    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    # -- tokenization, off the engine thread -------------------------------------------------------

    async def _off_thread(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.engine.tokenizer.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def _template(self, messages: list[dict], tools: ToolPlan | None = None) -> str:
        """The model's chat template applied to ``messages`` (and the tools the model may call);
        a 400 naming ``messages`` if it cannot be."""
        tokenizer = self.engine.tokenizer
        template_tools = None
        if tools is not None:
            messages, template_tools = with_tools(messages, tools, tokenizer.chat_template)
        try:
            return apply_chat_template(tokenizer, messages, template_tools)
        except InvalidRequestError as e:
            raise from_invalid_request(e) from None
        except Exception as e:  # a template that rejects these messages (e.g. the roles' order)
            raise bad_request(f"messages: the chat template failed: {e}", "messages") from None

    @cached_property
    def max_prompt_chars(self) -> int:
        """No text longer than this fits in the context, whatever it says: no token spells more
        characters than the vocabulary's longest entry (x4 where the tokenizer normalizes first,
        as composing can fold three characters into one)."""
        backend = self.engine.tokenizer.backend_tokenizer
        longest = max(map(len, backend.get_vocab(with_added_tokens=True)))
        return self.engine.config.max_model_len * longest * (1 if backend.normalizer is None else 4)

    def check_prompt_size(self, num_chars: int, param: str, num_messages: int = 0) -> None:
        """A quick 400 for a prompt that cannot fit, before the one tokenizer thread spends seconds
        on it while every other request waits (a 10 MB prompt took 28 s). A chat of more messages
        than the context has tokens cannot fit either: a template writes at least one per message."""
        context = self.engine.config.max_model_len
        if num_chars > self.max_prompt_chars or num_messages > context:
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
            await asyncio.to_thread(self.engine.grammars.compile, spec)
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

    # -- OpenAI endpoints ------------------------------------------------------------------------

    async def openai(self, request: Request, kind: Literal["completion", "chat"]) -> Response:
        if kind == "completion":
            req = await parse_body(request, CompletionRequest)
        else:
            req = await parse_body(request, ChatCompletionRequest)
        self.check_model(req.model)
        req.check_supported()
        names = dict(PARAM_NAMES)
        constraint, constraint_names = req.constraint()
        names.update(constraint_names)
        tools = None
        if kind == "completion":
            prompt_ids = [await self.encode(p) for p in req.prompts()]
            requested = req.max_tokens
            max_new = requested or COMPLETION_DEFAULT_MAX_TOKENS
            num_logprobs = req.logprobs
        else:
            names.update(prompt="messages", max_new_tokens="max_completion_tokens"
                         if req.max_completion_tokens else "max_tokens")
            tools = req.tool_plan()
            if tools.constrains:
                constraint = {"json_schema": tools.json_schema()}
                names["json_schema"] = "tools"
            prompt_ids = [await self.encode_chat([m.as_template_dict() for m in req.messages], tools)]
            requested = req.requested_max_tokens
            max_new = requested or max(1, self.max_total_tokens - len(prompt_ids[0]))
            num_logprobs = req.num_logprobs
        if requested is not None:
            self.check_context(max(len(ids) for ids in prompt_ids), requested, names["max_new_tokens"])
        req = self.with_model_defaults(req)
        try:
            params = req.sampling_params(max_new, num_logprobs, constraint)
        except InvalidRequestError as e:
            raise from_invalid_request(e, names) from None
        await self.check_constraint(params[0], names)
        n = req.n
        stream = await self.submit(request, [ids for ids in prompt_ids for _ in range(n)],
                                   params * len(prompt_ids), req.request_timeout_s, names, req.stream,
                                   req.cache_salt)
        builder = ResponseBuilder(kind, self.model_name, self.token_text)
        if req.stream:
            return event_stream(self._sse(stream, builder, n, req.include_usage, tools), stream)
        finals = await self.collect(request, stream)
        responses = []
        for i in range(len(finals)):
            d = finals[i]
            if d.response is None or d.finish_reason == "error":
                err = d.response.error if d.response is not None else "the engine failed"
                raise APIError(500, f"generation failed: {err}", type="server_error")
            responses.append(d.response)
        prompt_tokens = sum(responses[p * n].prompt_length for p in range(len(prompt_ids)))
        cached_tokens = sum(responses[p * n].num_cached_tokens for p in range(len(prompt_ids)))
        return JSONResponse(builder.full(responses, prompt_tokens, cached_tokens, tools))

    async def _sse(self, stream: Stream, builder: ResponseBuilder, n: int,
                   include_usage: bool, tools: ToolPlan | None = None) -> AsyncIterator[str]:
        if tools is not None and tools.mode != "none":
            async for event in self._tool_sse(stream, builder, n, include_usage, tools):
                yield event
            return
        started: set[int] = set()
        pending: dict[int, list[TokenLogprob]] = {}  # per choice: logprobs of tokens not yet sent
        usage = _StreamUsage(n)
        try:
            async for d in stream:
                usage.add(d)
                if d.finish_reason == "error":
                    yield _failed_event(d)
                    continue
                if d.error is not None:  # cut by the server (shutdown): say so, then the stream still ends well
                    yield sse(builder.chunk(d.index, d.text, d.finish_reason, first=d.index not in started,
                                            include_usage=include_usage, logprobs=tuple(pending.pop(d.index, ()))))
                    started.add(d.index)
                    yield _shutdown_event(d)
                    continue
                if d.logprobs:
                    pending.setdefault(d.index, []).extend(d.logprobs)
                if not d.text and d.finish_reason is None:
                    continue  # scheduled, or a token whose text is held back (its logprobs wait)
                yield sse(builder.chunk(d.index, d.text, d.finish_reason, first=d.index not in started,
                                        include_usage=include_usage, logprobs=tuple(pending.pop(d.index, ()))))
                started.add(d.index)
            if include_usage:
                yield usage.chunk(builder)
            yield SSE_DONE
        finally:
            stream.close()

    async def _tool_sse(self, stream: Stream, builder: ResponseBuilder, n: int, include_usage: bool,
                        tools: ToolPlan) -> AsyncIterator[str]:
        """A chat stream whose choices may call tools: each choice's text goes through its
        :class:`ToolCallStream`; a choice that called a tool finishes with ``tool_calls``."""
        choices: dict[int, ToolCallStream] = {}
        usage = _StreamUsage(n)
        try:
            async for d in stream:
                usage.add(d)
                if d.finish_reason == "error":
                    yield _failed_event(d)
                    continue
                first = d.index not in choices
                calls = choices.setdefault(d.index, ToolCallStream(tools))
                deltas = calls.push(d.text) if d.text else []
                if d.finish_reason is not None:
                    deltas += calls.finish()
                if first:
                    deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}] + deltas[1:]
                for delta in deltas:
                    yield sse(builder.chat_chunk(d.index, delta, None, include_usage=include_usage))
                if d.finish_reason is not None:
                    reason = "tool_calls" if calls.called and d.finish_reason == "stop" else d.finish_reason
                    yield sse(builder.chat_chunk(d.index, {}, reason, include_usage=include_usage))
                if d.error is not None:  # cut by the server (shutdown), as in _sse
                    yield _shutdown_event(d)
            if include_usage:
                yield usage.chunk(builder)
            yield SSE_DONE
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
            return event_stream(self._native_sse(stream), stream)
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
                        yield _shutdown_event(d)
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
        return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.config.max_model_len}

    async def detokenize(self, request: Request) -> dict:
        req = await parse_body(request, DetokenizeRequest)
        self.check_model(req.model)
        vocab = self.engine.model_config.vocab_size
        if not all(0 <= t < vocab for t in req.tokens):
            raise bad_request(f"tokens must be integers in [0, {vocab})", "tokens")
        text = await self._off_thread(self.engine.tokenizer.decode, req.tokens)
        return {"prompt": text}

    def health(self) -> JSONResponse:
        state = self.loop.state
        if state == "ready":
            return JSONResponse({"status": "ok"})
        body = {"status": state}
        if self.loop.error is not None:
            body["error"] = f"{type(self.loop.error).__name__}: {self.loop.error}"
        return JSONResponse(body, status_code=503)

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "fastgen"}
        if self.loop.state == "ready":
            card["max_model_len"] = self.engine.config.max_model_len
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
        return await server.openai(request, "completion")

    @app.post("/v1/chat/completions", **route_doc("/v1/chat/completions"))
    async def chat_completions(request: Request) -> Response:
        return await server.openai(request, "chat")

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
        if server.loop.state == "ready":
            cfg = server.engine.config
            server.telemetry.info.update(budget_tokens=cfg.scheduler.budget_tokens, num_blocks=cfg.cache.num_blocks,
                                         block_size=cfg.cache.block_size, max_seqs=cfg.scheduler.max_seqs)
        return StreamingResponse(server.telemetry.subscribe(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return app
