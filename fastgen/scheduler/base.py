"""The scheduler contract.

A scheduler returns, for the next forward pass, ``{request_id: num_tokens}`` (as an
ordered tuple of :class:`~fastgen.batch.ScheduledChunk`) under one token budget. It owns
the KV block allocator: admitting a request reserves blocks for every token it has,
growing a decode takes one block at a time, and preempting a request frees all of its
blocks (it is later recomputed from its prompt *and* the tokens it already generated,
so nothing it produced is lost).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..batch import ScheduledChunk
from ..request import Request


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler(Protocol):
    def add(self, request: Request) -> None:
        """Queue a new request (it holds no blocks until admitted)."""

    def schedule(self) -> StepPlan:
        """Plan the next step; may admit waiting requests and preempt running ones."""

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request and free its blocks."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    def has_work(self) -> bool: ...
