"""The scheduler contract.

A scheduler returns, for the next forward pass, ``{request_id: num_tokens}`` (as an
ordered tuple of :class:`~fastgen.batch.ScheduledChunk`) under one token budget. It owns
the KV block allocator: admitting a request reserves blocks for every token it has,
growing a decode takes one block at a time, and preempting a request frees all of its
blocks (it is later recomputed from its prompt *and* the tokens it already generated,
so nothing it produced is lost).

Request state has one owner: ``schedule()`` admits, grows and preempts; ``commit(plan,
sampled)`` advances ``num_computed_tokens`` and appends sampled tokens; ``finish`` frees. The
engine only reads requests between those calls (nano-vllm's ``postprocess``, vLLM v1's
``update_from_output``).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Protocol

from ..batch import ScheduledChunk
from ..request import Request


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Admission(Enum):
    """Why a request can or cannot be admitted now (DeepSpeed v2's SchedulingResult)."""

    FITS = "fits"
    KV_BLOCKS = "kv blocks"          # not now: too few free blocks (with the reserve)
    TOO_LONG = "too long"            # never: more blocks than the whole pool


class Scheduler(Protocol):
    def add(self, request: Request) -> None:
        """Queue a new request (it holds no blocks until admitted)."""

    def schedule(self) -> StepPlan:
        """Plan the next step; may admit waiting requests and preempt running ones."""

    def commit(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[Request]:
        """After the forward pass: advance every planned request by its chunk and append the
        token sampled for each request whose chunk completed its tokens (``sampled`` maps
        their ids to tokens). Returns those requests, in plan order. Finishing is the
        caller's decision (EOS, stop strings, length), through :meth:`finish`."""

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request and free its blocks."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    def has_work(self) -> bool: ...
