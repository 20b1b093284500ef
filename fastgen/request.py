"""Requests, their sampling parameters, and the responses handed back to users.

Vocabulary used across fastgen: a request's *tokens* are its prompt ids followed by
its generated ids; ``num_computed_tokens`` of them have their KV in the cache. The
scheduler gives a request ``num_tokens - num_computed_tokens`` tokens of work at most
per step; a step that completes them samples one new token. Prefill and decode are
derived facts: a request is decoding when exactly one token is left to compute and
its prompt has been processed once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # torch is imported by the engine, not by processes that only route requests
    import torch

import enum
import json
import math
import time
from dataclasses import dataclass, field, fields
from typing import Any


from .errors import InvalidRequestError
from .structured import GrammarSpec, GrammarState, json_schema_text


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS or a stop string
    LENGTH = "length"      # max_new_tokens / max_length / the model's context
    ABORT = "abort"        # cancelled by the caller
    TIMEOUT = "timeout"    # its deadline passed (ended by the serving layer)
    ERROR = "error"        # this request failed; others were unaffected

    def __str__(self) -> str:  # prints as the README and the wire say: "stop", not "FinishReason.STOP"
        return self.value


class RequestStatus(enum.Enum):
    WAITING = "waiting"    # queued, holds no KV blocks (new, or preempted)
    RUNNING = "running"    # admitted, holds KV blocks
    FINISHED = "finished"


def _check(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise InvalidRequestError(f"{param}: {message}", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass(frozen=True)
class SamplingParams:
    """DeepSpeed-MII's generate kwargs, with their meanings, plus fastgen's additions.

    max_length: cap on prompt + generated tokens (MII). ``None`` -> the model's context.
    max_new_tokens: cap on generated tokens.
    min_new_tokens: EOS and stop strings are ignored until this many tokens were generated.
    do_sample: False -> greedy (temperature, top_p, top_k, min_p are then not used).
    stop: strings matched in the generated text, across token boundaries; the match and
        what follows it are cut from the output. EOS still ends generation.
    ignore_eos: keep generating past EOS.
    return_full_text: prefix ``generated_text`` with the prompt text.
    repetition_penalty: HF's multiplicative penalty over prompt and generated tokens (1 = off).
    presence_penalty / frequency_penalty: OpenAI's additive penalties over generated tokens.
    seed: a private random stream for this request: its draws do not depend on what else
        shares the batch (its logits can, in their last bits, where matrix products are tiled
        differently for different batch sizes; in fp32 on CPU the outputs were identical in tests).
    logprobs: ``None`` -> none; ``k >= 0`` -> the chosen token's logprob and the top ``k``.
    prompt_logprobs: like ``logprobs``, for every prompt token after the first.
    json_schema / json_object / regex / choice / grammar: at most one output constraint
        (fastgen/structured.py): a JSON schema (dict or JSON text), any JSON object, a regular
        expression, one of a list of strings, or an EBNF grammar. The output is valid by
        construction; the request ends with ``stop`` when the grammar is complete.
    """

    max_length: int | None = None
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    return_full_text: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: dict | str | bool | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    MAX_LOGPROBS = 20
    MAX_CHOICES = 1024

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        _check(self.max_length is None or (_is_int(self.max_length) and self.max_length > 0),
               "max_length", f"must be a positive integer, got {self.max_length!r}")
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens > 0, "max_new_tokens",
               f"must be a positive integer, got {self.max_new_tokens!r}")
        _check(_is_int(self.min_new_tokens) and self.min_new_tokens >= 0, "min_new_tokens",
               f"must be a non-negative integer, got {self.min_new_tokens!r}")
        _check(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
               f"({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})")
        _check(isinstance(self.do_sample, bool), "do_sample", "must be a boolean")
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature",
               f"must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k",
               f"must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        _check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
               "stop", "must be a non-empty string or a list of non-empty strings")
        _check(len(self.stop) <= self.MAX_STOP_STRINGS and all(len(s) <= self.MAX_STOP_CHARS for s in self.stop),
               "stop", f"at most {self.MAX_STOP_STRINGS} strings of at most {self.MAX_STOP_CHARS} characters")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        _check(isinstance(self.return_full_text, bool), "return_full_text", "must be a boolean")
        _check(_is_num(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 100,
               "repetition_penalty", f"must be in [0.01, 100], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64), "seed",
               f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= self.MAX_LOGPROBS), name,
                   f"must be an integer in [0, {self.MAX_LOGPROBS}], got {value!r}")
        self._check_constraint()

    def _check_constraint(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        _check(isinstance(self.json_object, bool), "json_object", "must be a boolean")
        given = [n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        _check(len(given) <= 1, given[-1] if given else "", f"give at most one output constraint, got {given}")
        if self.json_schema is not None:
            _check(isinstance(self.json_schema, (dict, str)) or self.json_schema is True, "json_schema",
                   "must be a JSON schema (an object, its JSON text, or true)")
            object.__setattr__(self, "json_schema", json_schema_text(self.json_schema))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value), name, "must be a non-empty string")
        if self.choice is not None:
            _check(isinstance(self.choice, tuple) and 0 < len(self.choice) <= self.MAX_CHOICES
                   and all(isinstance(c, str) and c for c in self.choice), "choice",
                   f"must be a list of 1 to {self.MAX_CHOICES} non-empty strings")
        if given:
            # the grammar decides where the output ends: nothing to force past it or before it
            _check(not self.ignore_eos, "ignore_eos", f"cannot be combined with {given[0]}: the output "
                   "ends where the grammar is complete")
            _check(self.min_new_tokens == 0, "min_new_tokens", f"cannot be combined with {given[0]}: the "
                   "output ends where the grammar is complete")

    MIN_TEMPERATURE = 1e-5   # below this, sampling is greedy (as in vLLM)
    MAX_STOP_STRINGS = 16
    MAX_STOP_CHARS = 256

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature < self.MIN_TEMPERATURE

    @property
    def structured(self) -> GrammarSpec | None:
        """The output constraint, if any (validated in ``__post_init__``)."""
        if self.json_schema is not None:
            return GrammarSpec("json_schema", self.json_schema)
        if self.json_object:
            return GrammarSpec("json_object", "")
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec("choice", json.dumps(list(self.choice), ensure_ascii=False))
        if self.grammar is not None:
            return GrammarSpec("grammar", self.grammar)
        return None

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "SamplingParams":
        """Build from generate kwargs; an unknown kwarg raises instead of being ignored."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidRequestError(
                f"unknown generate argument(s) {unknown}; supported: {sorted(names)}",
                param=unknown[0])
        return cls(**kwargs)


@dataclass(frozen=True)
class TokenLogprob:
    """One position's logprobs: the chosen token and the ``top`` alternatives (id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass(frozen=True)
class Timings:
    """Seconds, measured with ``time.perf_counter`` from the request's arrival."""

    queue_wait_s: float | None       # arrival -> first admitted into a step
    time_to_first_token_s: float | None
    token_times_s: tuple[float, ...]  # arrival -> each generated token
    e2e_s: float | None

    @property
    def inter_token_s(self) -> tuple[float, ...]:
        t = self.token_times_s
        return tuple(b - a for a, b in zip(t, t[1:]))


@dataclass(frozen=True)
class Response:
    """The result of one prompt. ``token_ids`` are the generated ids only."""

    request_id: str
    generated_text: str
    token_ids: tuple[int, ...]
    prompt_length: int
    generated_length: int
    finish_reason: FinishReason
    timings: Timings
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    num_preemptions: int = 0
    error: str | None = None
    num_cached_tokens: int = 0    # prompt tokens whose KV came from the prefix cache

    def __str__(self) -> str:
        return self.generated_text


@dataclass(eq=False)  # identity: requests are compared by object, never by value
class Request:
    """Engine-side state of one generation. Mutated only by the engine and scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int                   # prompt + generated cap (OpenAI's max_tokens counts only the latter)
    prompt_text: str | None = None         # None when the prompt came as token ids (decoded on demand)
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    # prefix caching: the chain's root (model, tenant, salt), names of full blocks so far,
    # how many of block_ids are registered, and the prompt tokens found cached on admission
    cache_root: bytes = b""
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    # timings
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    # outputs
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    grammar_state: GrammarState | None = None   # the output constraint's matcher, once compiled

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """True when only the newest generated token is left to compute (derived, not a phase)."""
        return self.num_output_tokens > 0 and self.num_uncomputed_tokens == 1

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt logprobs are asked for and not all collected (a recompute after
        preemption does not collect them again)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]

    def timings(self) -> Timings:
        t0 = self.arrival_time
        return Timings(
            queue_wait_s=None if self.first_scheduled_time is None else self.first_scheduled_time - t0,
            time_to_first_token_s=self.token_times[0] - t0 if self.token_times else None,
            token_times_s=tuple(t - t0 for t in self.token_times),
            e2e_s=None if self.finished_time is None else self.finished_time - t0,
        )
