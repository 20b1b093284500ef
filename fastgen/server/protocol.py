"""The OpenAI wire protocol: request models, their mapping onto :class:`SamplingParams`, and
the JSON bodies of responses and stream chunks.

Requests are validated strictly (``"temperature": "0.5"`` is a type error, an unknown field is
rejected by name): a parameter we do not implement is refused, never ignored. OpenAI fields
that only have a meaning we do not support (``echo``, ``best_of``, ``logit_bias``...) are accepted
at their neutral value and refused otherwise.

Structured outputs (fastgen/structured.py): ``response_format`` (``text``, ``json_object``,
``json_schema``) on both endpoints, or vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``), one constraint per request. Tools: fastgen/server/tools.py.

Defaults follow OpenAI: ``temperature`` 1, ``top_p`` 1, ``n`` 1; ``max_tokens`` is 16 for
``/v1/completions`` (as OpenAI's legacy endpoint) and, for chat, whatever room the context and
the KV pool leave after the prompt. ``temperature`` 0 is greedy. fastgen extensions:
``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``repetition_penalty`` and
``request_timeout_s`` (a deadline counted from arrival; past it the request ends with
``finish_reason: "timeout"``). With ``n > 1`` and a ``seed``, choice ``i`` uses ``seed + i``.
``cache_salt`` (as vLLM's) partitions the prefix cache within the caller's tenant; the usage
reports ``prompt_tokens_details.cached_tokens``. The bodies of the answers: responses.py.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..request import SamplingParams
from .errors import APIError, bad_request
from .tools import Tool, ToolChoice, ToolPlan

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_N = 64

# SamplingParams' names -> the OpenAI fields they come from, for error messages.
PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class _Model(BaseModel):
    # NaN and Infinity (which the JSON parser takes) are refused as such, not as "less than 2"
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False


class JSONSchemaFormat(_Model):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None               # always enforced: the output is constrained


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Model):
    """vLLM's ``structured_outputs`` (one of them)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def constraint(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The output constraint as SamplingParams kwargs, and the HTTP names of those kwargs."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
        if rf is not None and rf.type == "json_object":
            return {"json_object": True}, {"json_object": "response_format"}
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format: json_schema.schema is required", "response_format")
            return {"json_schema": rf.json_schema.schema_}, {"json_schema": "response_format"}
        if rf is not None and rf.json_schema is not None:
            raise bad_request("response_format: json_schema is only allowed with type json_schema",
                              "response_format")
        if so is None:
            return {}, {}
        given = {k: v for k, v in (("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar), ("json_object", so.json_object or None))
                 if v is not None}
        if len(given) != 1:
            raise bad_request("structured_outputs: give exactly one of json, regex, choice, grammar, json_object",
                              "structured_outputs")
        return given, {k: "structured_outputs" for k in given}

    def check_supported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_new_tokens: int, logprobs: int | None,
                        constraint: dict[str, Any] | None = None) -> list[SamplingParams]:
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
            logprobs=logprobs, **(constraint or {}))
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


class CalledFunction(_Model):
    name: str
    arguments: str


class MessageToolCall(_Model):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None                   # a tool's answer to one of them

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:  # templates read the arguments as an object
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _arguments(c)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(call: MessageToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise bad_request(f"messages: the arguments of tool call {call.id!r} are not JSON", "messages") from None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_plan(self) -> ToolPlan:
        plan = ToolPlan.build(self.tools, self.tool_choice, self.parallel_tool_calls)
        if plan.mode != "none" and self.constraint()[0]:
            raise bad_request("tools (with tool_choice other than none) cannot be combined with an output "
                              "constraint (response_format or structured_outputs)", "tool_choice")
        if plan.mode != "none" and self.stream and self.logprobs:
            raise bad_request("logprobs are not streamed for requests with tools (ask without stream)", "logprobs")
        return plan

    def check_supported(self) -> None:
        super().check_supported()
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


class TokenizeRequest(_Model):
    """Give exactly one of ``prompt`` and ``messages`` (the chat template is applied to those)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"model {name!r} does not exist; this server serves {served!r}",
                    param="model", code="model_not_found")
