"""OpenAI function calling on top of structured outputs.

``tool_choice`` decides what the model may say:

- ``"none"``: plain text; the tools are not shown to the model.
- ``"auto"`` (the default with tools): free text; a tool call is recognised when the model
  writes it in the chat format's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks (Qwen2's and SmolLM's tool-aware templates use it).
- ``"required"``: the output is constrained to a JSON list of ``{"name", "arguments"}`` objects,
  one per call, each ``arguments`` constrained to its tool's ``parameters`` schema (one call at
  most with ``parallel_tool_calls: false``).
- ``{"type": "function", "function": {"name": f}}``: the output is constrained to ``f``'s
  arguments.

The chat template receives ``tools``. A template that does not read them (the embedded
SmolLM2-135M's) gets them in a system message instead, with the ``<tool_call>`` format.
Calls are answered as OpenAI's ``tool_calls`` (ids ``call_...``, ``finish_reason:
"tool_calls"``); a stream sends a named function's arguments as they are generated, and the
calls of ``required`` and ``auto`` once each is complete.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidRequestError
from ..structured import check_json_schema
from .errors import bad_request

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NO_ARGUMENTS = {"type": "object", "properties": {}}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDef(_Model):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None               # always enforced: the arguments are constrained


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str                           # JSON text, as OpenAI sends it

    def as_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request's tools mean for the engine and for its answer."""

    tools: tuple[Tool, ...]
    mode: Literal["none", "auto", "required", "named"]
    named: str | None = None
    parallel: bool = True

    @classmethod
    def build(cls, tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> "ToolPlan":
        tools = tuple(tools or ())
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise bad_request("tools: function names must be unique", "tools")
        for i, t in enumerate(tools):
            if t.function.parameters is not None:
                try:
                    check_json_schema(t.function.parameters, f"tools[{i}].function.parameters")
                except InvalidRequestError as e:
                    raise bad_request(str(e), "tools") from None
        if choice is None:
            choice = "auto" if tools else "none"
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise bad_request(f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice")
            return cls(tools, "named", choice.function.name, parallel is not False)
        if choice != "none" and not tools:
            raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
        return cls(tools, choice, None, parallel is not False)

    @property
    def constrains(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def shown(self) -> bool:
        """Whether the model sees the tools (all modes but ``none``)."""
        return self.mode != "none" and bool(self.tools)

    def _parameters(self, name: str) -> dict[str, Any]:
        fn = next(t.function for t in self.tools if t.function.name == name)
        return fn.parameters if fn.parameters is not None else NO_ARGUMENTS

    def json_schema(self) -> dict[str, Any] | None:
        """The schema the output is constrained to (``None``: not constrained)."""
        if self.mode == "named":
            return self._parameters(self.named)
        if self.mode != "required":
            return None
        defs, calls = {}, []
        for i, t in enumerate(self.tools):
            name = t.function.name
            key = f"tool_{i}"
            defs[key] = _rebase_refs(self._parameters(name), f"#/$defs/{key}")
            calls.append({"type": "object", "properties": {"name": {"const": name},
                                                           "arguments": {"$ref": f"#/$defs/{key}"}},
                          "required": ["name", "arguments"], "additionalProperties": False})
        schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1,
                  "$defs": defs}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    # -- prompts ---------------------------------------------------------------------------------

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.shown:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def system_text(self) -> str:
        """The tools, told in words, for a chat template that does not take ``tools``."""
        lines = "\n".join(json.dumps(t.function.model_dump(exclude_none=True), ensure_ascii=False)
                          for t in self.tools)
        return ("You can call the functions below; their signatures are JSON, one per line.\n"
                f"<tools>\n{lines}\n</tools>\n"
                f"To call a function, answer with {CALL_OPEN}{{\"name\": <function name>, "
                f"\"arguments\": <JSON object of its arguments>}}{CALL_CLOSE}, one block per call. "
                "Otherwise answer in plain text.")

    # -- answers ---------------------------------------------------------------------------------

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of one choice's whole text. A text that does not hold valid calls
        is content (``auto`` leaves the model free to answer in words)."""
        if self.mode == "named":
            return None, [ToolCall(new_call_id(), self.named, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens or a stop string
                return text, []
            return None, [ToolCall(new_call_id(), c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                          for c in calls]
        if self.mode == "auto":
            return parse_call_blocks(text, {t.function.name for t in self.tools})
        return text, []


_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S)


def parse_call_blocks(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """``<tool_call>{...}</tool_call>`` blocks (the last may lack its closing tag) -> calls; the
    text around them is the content. Any block that is not a call of a known tool: all content."""
    calls = []
    for m in _BLOCK.finditer(text):
        try:
            body = json.loads(m.group(1))
        except json.JSONDecodeError:
            return text, []
        if not (isinstance(body, dict) and body.get("name") in names):
            return text, []
        args = body.get("arguments", {})
        if isinstance(args, str):  # some models send the arguments as JSON text already
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return text, []
        if not isinstance(args, dict):
            return text, []
        calls.append(ToolCall(new_call_id(), body["name"], json.dumps(args, ensure_ascii=False)))
    if not calls:
        return text, []
    content = _BLOCK.sub("", text).strip()
    return content or None, calls


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with its local references ('#', '#/...') pointing under ``base``."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
                out[k] = base + v[1:]
            else:
                out[k] = _rebase_refs(v, base)
        return out
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


def with_tools(messages: list[dict[str, Any]], plan: ToolPlan, template: str | None) -> tuple[
        list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and ``tools`` argument for the chat template. A template that never mentions
    ``tools`` gets them as (the start of) the system message; assistant ``tool_calls`` become the
    ``<tool_call>`` blocks the model is asked to write."""
    tools = plan.template_tools()
    if template is not None and "tools" in template:
        return messages, tools
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            blocks = "".join(f"{CALL_OPEN}{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}{CALL_CLOSE}"
                             for c in calls)
            m = {"role": m["role"], "content": (m.get("content") or "") + blocks}
        out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + plan.system_text()}
        else:
            out.insert(0, {"role": "system", "content": plan.system_text()})
    return out, None


class ToolCallStream:
    """One streamed choice of a request with tools: text deltas in, OpenAI ``delta`` objects out.

    ``named``: each text delta is a fragment of the call's arguments. ``required``: the calls are
    sent when the choice finishes. ``auto``: text streams as content until something that may
    begin ``<tool_call>`` appears; from there it is held, and at the finish it is sent as calls
    if it holds calls, else as content.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._held = ""
        self._call_id = new_call_id()
        self._started = False
        self.called = False

    def push(self, text: str) -> list[dict[str, Any]]:
        if self.plan.mode == "named":
            if not self._started:
                self._started = self.called = True
                head = ToolCall(self._call_id, self.plan.named, text).as_json(0)
                return [{"tool_calls": [head]}]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []
        if self.plan.mode == "required" or (self.plan.mode == "auto" and CALL_OPEN in self._held + text):
            self._held += text
            return []
        if self.plan.mode != "auto":
            return [{"content": text}] if text else []
        text = self._held + text
        keep = _partial_tag_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        out = text[:len(text) - keep]
        return [{"content": out}] if out else []

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still to send when the choice finishes (``called``: calls were sent)."""
        if self.plan.mode == "named":
            return [] if self._started else self.push("")
        held, self._held = self._held, ""
        if not held:
            return []
        content, calls = self.plan.parse(held)
        if not calls:
            return [{"content": held}]
        self.called = True
        out = [{"content": content}] if content else []
        return out + [{"tool_calls": [c.as_json(i)]} for i, c in enumerate(calls)]


def _partial_tag_len(text: str) -> int:
    """Length of the longest end of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
