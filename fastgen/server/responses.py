"""The JSON bodies of OpenAI answers: whole responses and stream chunks, one class per endpoint
(:class:`CompletionBodies` for ``/v1/completions``, :class:`ChatBodies` for
``/v1/chat/completions``) over what they share (:class:`ResponseBodies`). Finish reasons arrive as
:class:`~fastgen.request.FinishReason` and are written as their wire strings here, the one place
they become JSON (with chat's ``tool_calls``, which is not an engine reason).
"""
from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar

from ..request import FinishReason, Response, TokenLogprob
from .tools import ToolPlan

TokenText = Callable[[int], str]
Reason = FinishReason | str | None   # str: "tool_calls"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def wire_reason(reason: Reason) -> str | None:
    return None if reason is None else str(reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens``: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(lps: tuple[TokenLogprob, ...], token_text: TokenText,
                        text_offset: int = 0) -> dict[str, Any]:
    """``text_offset``: where the first token starts in the choice's text (a stream's later chunks)."""
    tokens = [token_text(lp.token_id) for lp in lps]
    offsets, pos = [], text_offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{token_text(i): v for i, v in lp.top.items()} for lp in lps],
            "text_offset": offsets}


def chat_logprobs(lps: tuple[TokenLogprob, ...], token_text: TokenText) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in sorted(lp.top.items(), key=lambda kv: -kv[1])]}
                        for lp in lps]}


class ResponseBodies(ABC):
    """The bodies of one HTTP request: the whole response, or its stream chunks.
    ``token_text`` gives the text of one token id, for logprobs."""

    id_prefix: ClassVar[str]
    full_object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, model: str, token_text: TokenText) -> None:
        self.model = model
        self.token_text = token_text
        self.id = new_id(self.id_prefix)
        self.created = int(time.time())

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, responses: list[Response], prompt_tokens: int, cached_tokens: int = 0,
             tools: ToolPlan | None = None) -> dict[str, Any]:
        """``responses``: one per choice, in choice-index order. With ``tools``, a chat choice's
        text is parsed for tool calls."""
        body = self._envelope(self.full_object)
        body["choices"] = [self.full_choice(i, r, tools) for i, r in enumerate(responses)]
        body["usage"] = usage(prompt_tokens, sum(r.generated_length for r in responses), cached_tokens)
        return body

    @abstractmethod
    def full_choice(self, index: int, r: Response, tools: ToolPlan | None) -> dict[str, Any]:
        """One choice of the whole (non-streamed) body."""

    @abstractmethod
    def chunk(self, index: int, text: str, finish_reason: Reason, *, first: bool, include_usage: bool,
              logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        """One choice's chunk. ``logprobs``: those of the tokens since its last chunk (none: ``null``);
        a choice's chunks together carry what the whole response would."""

    def _chunk_body(self, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
        body = self._envelope(self.chunk_object)
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        body = self._envelope(self.chunk_object)
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body


class CompletionBodies(ResponseBodies):
    id_prefix = "cmpl"
    full_object = chunk_object = "text_completion"

    def __init__(self, model: str, token_text: TokenText) -> None:
        super().__init__(model, token_text)
        self._text_offsets: dict[int, int] = {}  # choice index -> length of its streamed tokens' text

    def full_choice(self, index: int, r: Response, tools: ToolPlan | None) -> dict[str, Any]:
        lp = None if r.logprobs is None else completion_logprobs(r.logprobs, self.token_text)
        return {"index": index, "text": r.generated_text, "logprobs": lp, "finish_reason": wire_reason(r.finish_reason)}

    def chunk(self, index: int, text: str, finish_reason: Reason, *, first: bool, include_usage: bool,
              logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        lp = None
        if logprobs:
            lp = completion_logprobs(logprobs, self.token_text, self._text_offsets.get(index, 0))
            self._text_offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return self._chunk_body({"index": index, "text": text, "logprobs": lp,
                                 "finish_reason": wire_reason(finish_reason)}, include_usage)


class ChatBodies(ResponseBodies):
    id_prefix = "chatcmpl"
    full_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def full_choice(self, index: int, r: Response, tools: ToolPlan | None) -> dict[str, Any]:
        reason = wire_reason(r.finish_reason)
        lp = None if r.logprobs is None else chat_logprobs(r.logprobs, self.token_text)
        message: dict[str, Any] = {"role": "assistant", "content": r.generated_text}
        if tools is not None and tools.mode != "none":
            content, calls = tools.parse(r.generated_text)
            message["content"] = content
            if calls:
                message["tool_calls"] = [c.as_json() for c in calls]
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}

    def chunk(self, index: int, text: str, finish_reason: Reason, *, first: bool, include_usage: bool,
              logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else (
            {"content": text} if text else {})
        return self.chat_chunk(index, delta, finish_reason, include_usage=include_usage, logprobs=logprobs)

    def chat_chunk(self, index: int, delta: dict[str, Any], finish_reason: Reason, *, include_usage: bool,
                   logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        """One chat choice's chunk with this ``delta`` (content, or tool calls)."""
        lp = chat_logprobs(logprobs, self.token_text) if logprobs else None
        return self._chunk_body({"index": index, "delta": delta, "logprobs": lp,
                                 "finish_reason": wire_reason(finish_reason)}, include_usage)
