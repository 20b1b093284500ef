"""Structured outputs: what a request may constrain its output to, and the grammars that enforce it.

A request asks for at most one :class:`GrammarSpec`: a JSON schema, any JSON object, a regular
expression, one of a list of strings, or an EBNF grammar. The engine owns one
:class:`GrammarCompiler` built from the model's tokenizer (xgrammar, its cache on): compiling runs
on the compiler's own thread, never on the engine's, and a request waits outside the scheduler
until its grammar is ready. A constrained request then carries a :class:`GrammarState` (an
xgrammar matcher) whose invariant is: it has accepted exactly the request's generated tokens.
Only rows that sample get a mask (:func:`apply_grammar_masks`), and the token sampled is accepted
once, after the scheduler commits it; a preempted request keeps its matcher, because
recomputation re-reads tokens it already accepted and samples only the next one.

JSON schemas are checked against the keywords the grammar really enforces before anything is
compiled (:func:`check_json_schema`): xgrammar quietly ignores some (``not``, ``uniqueItems``,
``if``...), and a constraint that is not enforced must be refused, not pretended.
"""
from __future__ import annotations

import functools
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from typing import TYPE_CHECKING

from .errors import InvalidRequestError

if TYPE_CHECKING:   # imported where masks are made (the engine), not by processes that only route requests
    import torch

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# The constraint's name in SamplingParams for each kind (errors name it).
PARAM_OF_KIND: dict[str, str] = {"json_schema": "json_schema", "json_object": "json_object",
                                 "regex": "regex", "choice": "choice", "grammar": "grammar"}


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint. ``source``: the schema as JSON text, the regex, the EBNF,
    or the choices as a JSON list (hashable, so that equal constraints share a compiled grammar)."""

    kind: GrammarKind
    source: str

    @property
    def param(self) -> str:
        return PARAM_OF_KIND[self.kind]


# -- JSON schema: the keywords the grammar enforces -------------------------------------------

_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                "deprecated", "readOnly", "writeOnly"}
_KEYWORDS_BY_TYPE = {
    "object": {"properties", "required", "additionalProperties", "minProperties", "maxProperties"},
    "array": {"items", "prefixItems", "minItems", "maxItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "boolean": set(), "null": set(),
}
_GENERAL = {"type", "enum", "const", "anyOf", "$ref", "$defs", "definitions"}
SUPPORTED_KEYWORDS = frozenset(_ANNOTATIONS | _GENERAL | set().union(*_KEYWORDS_BY_TYPE.values()))
SUPPORTED_FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6",
                               "uri", "uuid"})
MAX_SCHEMA_CHARS = 64_000


def check_json_schema(schema: Any, param: str = "json_schema") -> None:
    """Raise :class:`InvalidRequestError` naming the first keyword (and where it is) that the
    grammar would not enforce. Accepts a dict or ``True``/``{}`` (any JSON value)."""
    _check_node(schema, "#", param)


def _fail(param: str, where: str, message: str) -> None:
    raise InvalidRequestError(f"{param}: {message} (at {where})", param=param)


def _check_node(node: Any, where: str, param: str) -> None:
    if node is True:
        return
    if not isinstance(node, dict):
        _fail(param, where, f"a schema must be an object or true, got {json.dumps(node)[:80]}")
    unsupported = sorted(set(node) - SUPPORTED_KEYWORDS)
    if unsupported:
        _fail(param, where, f"unsupported JSON schema keyword(s) {unsupported}; supported: "
                            f"{sorted(SUPPORTED_KEYWORDS - _ANNOTATIONS)}")
    types = node.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        bad = [t for t in names if t not in _KEYWORDS_BY_TYPE]
        if bad or not names:
            _fail(param, where, f"unknown type {bad or types!r}")
    fmt = node.get("format")
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        _fail(param, where, f"unsupported string format {fmt!r}; supported: {sorted(SUPPORTED_FORMATS)}")
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        _fail(param, where, f"only local references ('#/...') are supported, got $ref {ref!r}")
    for key in ("properties", "$defs", "definitions"):
        children = node.get(key, {})
        if not isinstance(children, dict):
            _fail(param, where, f"{key} must be an object")
        for name, child in children.items():
            _check_node(child, f"{where}/{key}/{name}", param)
    for key in ("additionalProperties", "items"):
        child = node.get(key)
        if child is not None and child is not False:
            _check_node(child, f"{where}/{key}", param)
    for key in ("prefixItems", "anyOf"):
        if key not in node:
            continue
        children = node[key]
        if not isinstance(children, list) or not children:
            _fail(param, where, f"{key} must be a non-empty list of schemas")
        for i, child in enumerate(children):
            _check_node(child, f"{where}/{key}/{i}", param)


def json_schema_text(schema: Any, param: str = "json_schema") -> str:
    """``schema`` (a dict, ``True``, or its JSON text) checked and as canonical JSON text."""
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_CHARS:
            raise InvalidRequestError(f"{param}: longer than {MAX_SCHEMA_CHARS} characters", param=param)
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{param}: not valid JSON: {e}", param=param) from None
    check_json_schema(schema, param)
    text = json.dumps({} if schema is True else schema, ensure_ascii=False)  # properties keep their order
    if len(text) > MAX_SCHEMA_CHARS:
        raise InvalidRequestError(f"{param}: longer than {MAX_SCHEMA_CHARS} characters", param=param)
    return text


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF accepting exactly one of ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# -- compiling, off the engine thread ---------------------------------------------------------

class GrammarCompiler:
    """One per engine: xgrammar's compiler over the model's tokenizer, with its cache on.

    ``vocab_size`` is the width of the model's logits (it may exceed the tokenizer's: the extra
    ids are never allowed). :meth:`submit` compiles on this object's own thread and returns a
    future; :meth:`compile` compiles in the caller's thread (the server's request handlers use it
    to answer a bad grammar with a 400, and warm the cache the engine's compile then hits).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=True)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastgen-grammar")
        # masks get their own thread: a long compile never delays a step's masks
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastgen-mask")
        self._lock = threading.Lock()  # one compile at a time: the cache fills once per grammar

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar; raises :class:`InvalidRequestError` naming ``spec.param``."""
        c = self._compiler
        try:
            with self._lock:
                if spec.kind == "json_schema":
                    return c.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
                if spec.kind == "json_object":
                    return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
                if spec.kind == "regex":
                    return c.compile_regex(spec.source)
                if spec.kind == "choice":
                    return c.compile_grammar(choice_grammar(tuple(json.loads(spec.source))))
                return c.compile_grammar(spec.source)
        except Exception as e:  # xgrammar's parse errors carry the C++ file and line first
            message = str(e).split(": ", 1)[-1] if "/cpp/" in str(e) else str(e)
            raise InvalidRequestError(f"{spec.param}: cannot be compiled: {message.strip()}",
                                      param=spec.param) from None

    def submit(self, spec: GrammarSpec) -> "Future[Any]":
        return self._pool.submit(self.compile, spec)

    def bias_async(self, states: list[tuple[int, "GrammarState"]]) -> "Future[torch.Tensor]":
        """:func:`grammar_bias` of ``states`` on the mask thread, so that it is computed while the
        engine's thread runs the forward pass. The matchers must not change until the future is
        done (the engine accepts tokens only after sampling)."""
        return self._mask_pool.submit(grammar_bias, states, self.vocab_size)

    def matcher(self, compiled: Any, spec: GrammarSpec | None = None) -> "GrammarState":
        """A fresh matcher of ``compiled``; for JSON (``spec`` of kind json_schema/json_object) it
        also forbids every token holding a control character (see :attr:`control_token_ids`)."""
        banned = self.control_token_ids if spec is not None and spec.kind in ("json_schema", "json_object") else None
        return GrammarState(self._xgr.GrammarMatcher(compiled), self.vocab_size, banned)

    @functools.cached_property
    def control_token_ids(self) -> "torch.Tensor":
        """Tokens whose bytes hold a control character (U+0000-U+001F). Compact JSON (no free
        whitespace, as fastgen compiles it) can hold none: inside strings they must be escaped,
        outside only spaces separate. xgrammar 0.2.9 lets them into length-limited strings
        (``maxLength``: ``[^"\\\r\n]{0,n}``), which gave ``"# Jes\x05"``, invalid JSON
        (found by tests/e2e/test_structured.py); forbidding these tokens closes that for every
        schema. Special tokens (EOS) decode to no bytes and stay allowed."""
        import torch

        vocab = self.tokenizer_info.decoded_vocab
        ids = [i for i, b in enumerate(vocab[:self.vocab_size]) if any(c < 0x20 for c in b)]
        return torch.tensor(ids, dtype=torch.long)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's matcher. Invariant: it has accepted exactly the request's generated tokens
    (``num_accepted``), so a recomputed request (preemption) is never advanced twice."""

    def __init__(self, matcher: Any, vocab_size: int, banned: "torch.Tensor | None" = None) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size       # the width of the model's logits
        self.num_accepted = 0
        self.banned = banned               # token ids forbidden whatever the grammar allows

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        ok = self._matcher.accept_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted its stop token: nothing may follow."""
        return self._matcher.is_terminated()


# [256, 8]: for each byte value, 0 where its bit j is set (token allowed) and -inf where it is not
@functools.cache
def _byte_bias() -> "torch.Tensor":
    """[256, 8]: 0 where bit i of the byte is set, -inf where it is clear."""
    import torch

    return torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def grammar_bias(states: list[tuple[int, GrammarState]], vocab_size: int) -> torch.Tensor:
    """[len(states), vocab_size] fp32, one row per state: 0 on the tokens its grammar allows next,
    -inf elsewhere. xgrammar fills a bitmask (one bit per token); it is unpacked by looking up its
    bytes, little-endian as xgrammar packs them, in ``_byte_bias()``. Adding this to the logits costs
    the engine's thread 0.07 ms for 8 rows here, against 1.9 ms for xgrammar's CPU apply
    (``apply_token_bitmask_inplace``); the unpacking, 0.3 ms, runs on the mask thread."""
    import torch
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)      # [k, ceil(vocab / 32)] int32
    for j, (_, state) in enumerate(states):
        state.fill(bitmask, j)
    k = len(states)
    bias = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), _byte_bias()).view(k, -1)[:, :vocab_size]
    for j, (_, state) in enumerate(states):
        if state.banned is not None and state.banned.numel():
            bias[j].index_fill_(0, state.banned, float("-inf"))
    return bias


def apply_grammar_masks(logits: torch.Tensor, states: list[tuple[int, GrammarState]],
                        bias: torch.Tensor | None = None) -> None:
    """In place: ``-inf`` on every token the grammar forbids, for the rows ``states`` name (their
    index into ``logits`` [n, vocab] fp32); allowed tokens and other rows are untouched. ``bias``:
    :func:`grammar_bias` of ``states`` if already computed (:meth:`GrammarCompiler.bias_async`)."""
    if not states:
        return
    import torch

    if bias is None:
        bias = grammar_bias(states, states[0][1].vocab_size)
    bias = bias.to(logits.device)
    rows = [i for i, _ in states]
    if rows == list(range(logits.shape[0])):
        logits.add_(bias)
    else:
        logits.index_add_(0, torch.tensor(rows, device=logits.device), bias)
