"""The OpenAI wire protocol: request models, their mapping onto :class:`SamplingParams`, and
the JSON bodies of responses and stream chunks.

Requests are validated strictly (``"temperature": "0.5"`` is a type error, an unknown field is
rejected by name): a parameter we do not implement is refused, never ignored. OpenAI fields
that only have a meaning we do not support (``echo``, ``best_of``, ``logit_bias``, ``tools``...)
are accepted at their neutral value and refused otherwise.

Defaults follow OpenAI: ``temperature`` 1, ``top_p`` 1, ``n`` 1; ``max_tokens`` is 16 for
``/v1/completions`` (as OpenAI's legacy endpoint) and, for chat, whatever room the context and
the KV pool leave after the prompt. ``temperature`` 0 is greedy. fastgen extensions:
``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``repetition_penalty`` and
``request_timeout_s`` (a deadline counted from arrival; past it the request ends with
``finish_reason: "timeout"``). With ``n > 1`` and a ``seed``, choice ``i`` uses ``seed + i``.
``cache_salt`` (as vLLM's) partitions the prefix cache within the caller's tenant; the usage
reports ``prompt_tokens_details.cached_tokens``.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..request import Response, SamplingParams, TokenLogprob
from .errors import APIError, bad_request

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_N = 64

# SamplingParams' names -> the OpenAI fields they come from, for error messages.
PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Model):
    include_usage: bool = False


class _GenerationRequest(_Model):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None                      # accepted for compatibility; not used
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None   # only empty
    # fastgen extensions
    top_k: int | None = Field(None, ge=-1)       # 0 or -1 = off
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    repetition_penalty: float | None = Field(None, gt=0)
    request_timeout_s: float | None = Field(None, gt=0)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    def check_supported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_new_tokens: int, logprobs: int | None) -> list[SamplingParams]:
        """One SamplingParams per choice (``n``); raises the engine's InvalidRequestError."""
        if self.min_tokens > max_new_tokens:
            raise bad_request(f"min_tokens ({self.min_tokens}) must not exceed the maximum number of "
                              f"tokens to generate ({max_new_tokens})", "min_tokens")
        temperature = 1.0 if self.temperature is None else self.temperature
        common = dict(
            max_new_tokens=max_new_tokens, min_new_tokens=self.min_tokens,
            do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=max(0, self.top_k or 0),
            min_p=self.min_p or 0.0, stop=_stops(self.stop), ignore_eos=self.ignore_eos,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            logprobs=logprobs)
        return [SamplingParams(**common, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise bad_request("best_of is not supported (use n)", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise bad_request("prompt must be a non-empty string or token list (or a list of them)", "prompt")
        return prompts


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None    # only {"type": "text"}
    tools: list[dict[str, Any]] | None = None        # only empty
    tool_choice: str | dict[str, Any] | None = None  # only "none"
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise bad_request("tools are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported", "tool_choice")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


NativePrompt = str | list[int] | list[ChatMessage]


class GenerateRequest(_Model):
    """fastgen's native ``POST /generate``: the pipeline's prompts and generate kwargs (MII's names
    and defaults, passed through to :class:`SamplingParams`), plus ``stream`` and a deadline."""

    model_config = ConfigDict(extra="allow", strict=True)
    prompts: NativePrompt | list[NativePrompt]
    stream: bool = False
    request_timeout_s: float | None = Field(None, gt=0)
    model: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    def prompt_list(self) -> list[str | list[int] | list[dict[str, str]]]:
        """Each prompt as the pipeline takes it (a chat as template dicts)."""
        p = self.prompts
        single = isinstance(p, str) or not p or not isinstance(p[0], (str, list))
        prompts = [p] if single else list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise bad_request("prompts: give a prompt or a non-empty list of non-empty prompts", "prompts")
        if self.stream and len(prompts) != 1:
            raise bad_request("stream: true takes exactly one prompt", "stream")
        return [[m.as_template_dict() for m in x] if x and isinstance(x[0], ChatMessage) else x for x in prompts]

    def sampling_params(self) -> SamplingParams:
        return SamplingParams.from_kwargs(dict(self.model_extra or {}))


# -- responses -----------------------------------------------------------------------------------

TokenText = Callable[[int], str]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


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


class ResponseBuilder:
    """Builds the bodies of one HTTP request: the whole response, or its stream chunks.
    ``token_text`` gives the text of one token id, for logprobs."""

    def __init__(self, kind: Literal["completion", "chat"], model: str, token_text: TokenText) -> None:
        self.kind = kind
        self.model = model
        self.token_text = token_text
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())
        self._text_offsets: dict[int, int] = {}  # choice index -> length of its streamed tokens' text

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, responses: list[Response], prompt_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """``responses``: one per choice, in choice-index order."""
        out = []
        for i, r in enumerate(responses):
            reason = r.finish_reason.value
            if self.kind == "completion":
                lp = None if r.logprobs is None else completion_logprobs(r.logprobs, self.token_text)
                out.append({"index": i, "text": r.generated_text, "logprobs": lp, "finish_reason": reason})
            else:
                lp = None if r.logprobs is None else chat_logprobs(r.logprobs, self.token_text)
                out.append({"index": i, "message": {"role": "assistant", "content": r.generated_text},
                            "logprobs": lp, "finish_reason": reason})
        body = self._envelope("text_completion" if self.kind == "completion" else "chat.completion")
        body["choices"] = out
        body["usage"] = usage(prompt_tokens, sum(r.generated_length for r in responses), cached_tokens)
        return body

    def chunk(self, index: int, text: str, finish_reason: str | None, *, first: bool, include_usage: bool,
              logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        """One choice's chunk. ``logprobs``: those of the tokens since its last chunk (none: ``null``);
        a choice's chunks together carry what the whole response would."""
        if self.kind == "completion":
            lp = None
            if logprobs:
                lp = completion_logprobs(logprobs, self.token_text, self._text_offsets.get(index, 0))
                self._text_offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            body = self._envelope("text_completion")
            body["choices"] = [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}]
        else:
            lp = chat_logprobs(logprobs, self.token_text) if logprobs else None
            body = self._envelope("chat.completion.chunk")
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else (
                {"content": text} if text else {})
            body["choices"] = [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        body = self._envelope("text_completion" if self.kind == "completion" else "chat.completion.chunk")
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"model {name!r} does not exist; this server serves {served!r}",
                    param="model", code="model_not_found")
