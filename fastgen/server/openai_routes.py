"""OpenAI's two generation endpoints as two small classes over one generic handler.

:class:`Completions` (``/v1/completions``) and :class:`Chat` (``/v1/chat/completions``) each say
what differs: the request model, how the prompts become token ids (text, or messages through the
chat template and the tools the model may call), the default and field names of ``max_tokens``,
the response bodies (responses.py), and how a stream is written (chat with tools goes through
:class:`~fastgen.server.tools.ToolCallStream`). :func:`answer` is everything else, once.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, ClassVar, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..errors import InvalidRequestError
from ..request import FinishReason, TokenLogprob
from .errors import APIError, from_invalid_request
from .http import event_stream, parse_body, sse
from .protocol import (COMPLETION_DEFAULT_MAX_TOKENS, PARAM_NAMES, ChatCompletionRequest, CompletionRequest,
                       _GenerationRequest)
from .responses import ChatBodies, CompletionBodies, ResponseBodies
from .stream import Delta, Stream
from .tools import ToolCallStream, ToolPlan

if TYPE_CHECKING:
    from .app import Server

SSE_DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class Prepared:
    """One request, ready to submit: what the endpoint made of its prompts and limits."""

    prompt_ids: list[list[int]]          # one per prompt (each is submitted ``n`` times)
    requested_max_tokens: int | None     # as the client gave it (None: the endpoint's default applies)
    max_new_tokens: int
    num_logprobs: int | None
    constraint: dict[str, Any]           # SamplingParams kwargs of the output constraint
    param_names: dict[str, str]          # SamplingParams' names -> this endpoint's fields, for 400s
    tools: ToolPlan | None = None


class OpenAIEndpoint(ABC):
    request_model: ClassVar[type[_GenerationRequest]]
    bodies: ClassVar[type[ResponseBodies]]

    @abstractmethod
    async def prepare(self, server: "Server", req: Any) -> Prepared:
        """The endpoint's request turned into prompts, limits and the output constraint."""

    def events(self, stream: Stream, bodies: Any, n: int, include_usage: bool,
               tools: ToolPlan | None) -> AsyncIterator[str]:
        return text_events(stream, bodies, n, include_usage)


class Completions(OpenAIEndpoint):
    request_model = CompletionRequest
    bodies = CompletionBodies

    async def prepare(self, server: "Server", req: CompletionRequest) -> Prepared:
        constraint, names = req.constraint()
        return Prepared([await server.encode(p) for p in req.prompts()], req.max_tokens,
                        req.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, req.logprobs, constraint,
                        {**PARAM_NAMES, **names})


class Chat(OpenAIEndpoint):
    request_model = ChatCompletionRequest
    bodies = ChatBodies

    async def prepare(self, server: "Server", req: ChatCompletionRequest) -> Prepared:
        constraint, constraint_names = req.constraint()
        names = {**PARAM_NAMES, **constraint_names, "prompt": "messages",
                 "max_new_tokens": "max_completion_tokens" if req.max_completion_tokens else "max_tokens"}
        tools = req.tool_plan()
        if tools.constrains:
            constraint = {"json_schema": tools.json_schema()}
            names["json_schema"] = "tools"
        prompt_ids = [await server.encode_chat([m.as_template_dict() for m in req.messages], tools)]
        requested = req.requested_max_tokens
        max_new = requested or max(1, server.facts.max_total_tokens - len(prompt_ids[0]))
        return Prepared(prompt_ids, requested, max_new, req.num_logprobs, constraint, names, tools)

    def events(self, stream: Stream, bodies: ChatBodies, n: int, include_usage: bool,
               tools: ToolPlan | None) -> AsyncIterator[str]:
        if tools is not None and tools.mode != "none":
            return tool_events(stream, bodies, n, include_usage, tools)
        return text_events(stream, bodies, n, include_usage)


async def answer(server: "Server", request: Request, endpoint: OpenAIEndpoint) -> Response:
    """The handler of both endpoints: parse, prepare, check, submit, then stream or collect."""
    req = await parse_body(request, endpoint.request_model)
    server.check_model(req.model)
    req.check_supported()
    prep = await endpoint.prepare(server, req)
    names = prep.param_names
    if prep.requested_max_tokens is not None:
        server.check_context(max(len(ids) for ids in prep.prompt_ids), prep.requested_max_tokens,
                             names["max_new_tokens"])
    req = server.with_model_defaults(req)
    try:
        params = req.sampling_params(prep.max_new_tokens, prep.num_logprobs, prep.constraint)
    except InvalidRequestError as e:
        raise from_invalid_request(e, names) from None
    await server.check_constraint(params[0], names)
    n = req.n
    stream = await server.submit(request, [ids for ids in prep.prompt_ids for _ in range(n)],
                                 params * len(prep.prompt_ids), req.request_timeout_s, names, req.stream,
                                 req.cache_salt)
    bodies = endpoint.bodies(server.model_name, server.token_text)
    if req.stream:
        return event_stream(endpoint.events(stream, bodies, n, req.include_usage, prep.tools), stream.close)
    finals = await server.collect(request, stream)
    responses = []
    for i in range(len(finals)):
        d = finals[i]
        if d.response is None or d.finish_reason is FinishReason.ERROR:
            err = d.response.error if d.response is not None else "the engine failed"
            raise APIError(500, f"generation failed: {err}", type="server_error")
        responses.append(d.response)
    num_prompts = len(prep.prompt_ids)
    prompt_tokens = sum(responses[p * n].prompt_length for p in range(num_prompts))
    cached_tokens = sum(responses[p * n].num_cached_tokens for p in range(num_prompts))
    return JSONResponse(bodies.full(responses, prompt_tokens, cached_tokens, prep.tools))


# -- streams --------------------------------------------------------------------------------------

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

    def chunk(self, bodies: ResponseBodies) -> str:
        return sse(bodies.usage_chunk(self.prompt_tokens, self.completion_tokens, self.cached_tokens))


def failed_event(d: Delta) -> str:
    """The error event of a choice the engine failed."""
    msg = d.response.error if d.response is not None else "the engine failed"
    return sse(APIError(500, f"generation failed: {msg}", type="server_error").body())


def shutdown_event(d: Delta) -> str:
    """The error event of a choice the server cut while shutting down."""
    return sse(APIError(503, d.error, type="server_error", code="server_shutdown").body())


async def _events(stream: Stream, bodies: ResponseBodies, n: int, include_usage: bool,
                  on_delta: Callable[[Delta], Iterator[str]]) -> AsyncIterator[str]:
    """The frame of every OpenAI stream: each delta's events (``on_delta``; a choice the engine
    failed gets an error event instead), the usage chunk when asked for, ``[DONE]``; the engine
    requests are aborted however the stream ends."""
    usage = _StreamUsage(n)
    try:
        async for d in stream:
            usage.add(d)
            if d.finish_reason is FinishReason.ERROR:
                yield failed_event(d)
                continue
            for event in on_delta(d):
                yield event
        if include_usage:
            yield usage.chunk(bodies)
        yield SSE_DONE
    finally:
        stream.close()


def text_events(stream: Stream, bodies: ResponseBodies, n: int, include_usage: bool) -> AsyncIterator[str]:
    """A stream of text chunks; a token's logprobs travel with the chunk that carries its text."""
    started: set[int] = set()
    pending: dict[int, list[TokenLogprob]] = {}  # per choice: logprobs of tokens not yet sent

    def on_delta(d: Delta) -> Iterator[str]:
        if d.logprobs:
            pending.setdefault(d.index, []).extend(d.logprobs)
        if not d.text and d.finish_reason is None:
            return  # scheduled, or a token whose text is held back (its logprobs wait)
        yield sse(bodies.chunk(d.index, d.text, d.finish_reason, first=d.index not in started,
                               include_usage=include_usage, logprobs=tuple(pending.pop(d.index, ()))))
        started.add(d.index)
        if d.error is not None:  # cut by the server (shutdown): say so, then the stream still ends well
            yield shutdown_event(d)

    return _events(stream, bodies, n, include_usage, on_delta)


def tool_events(stream: Stream, bodies: ChatBodies, n: int, include_usage: bool,
                tools: ToolPlan) -> AsyncIterator[str]:
    """A chat stream whose choices may call tools: each choice's text goes through its
    :class:`ToolCallStream`; a choice that called a tool finishes with ``tool_calls``."""
    choices: dict[int, ToolCallStream] = {}

    def on_delta(d: Delta) -> Iterator[str]:
        first = d.index not in choices
        calls = choices.setdefault(d.index, ToolCallStream(tools))
        deltas = calls.push(d.text) if d.text else []
        if d.finish_reason is not None:
            deltas += calls.finish()
        if first:
            deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}] + deltas[1:]
        for delta in deltas:
            yield sse(bodies.chat_chunk(d.index, delta, None, include_usage=include_usage))
        if d.finish_reason is not None:
            called = calls.called and d.finish_reason is FinishReason.STOP
            yield sse(bodies.chat_chunk(d.index, {}, "tool_calls" if called else d.finish_reason,
                                        include_usage=include_usage))
        if d.error is not None:  # cut by the server (shutdown), as in text_events
            yield shutdown_event(d)

    return _events(stream, bodies, n, include_usage, on_delta)
