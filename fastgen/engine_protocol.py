"""The engine as its drivers see it: the few methods that the server's engine loop
(fastgen/server/engine_loop.py) and the benchmark's in-process target (fastgen/bench/engine_target.py)
call. :class:`fastgen.engine.Engine` satisfies it, and so must the fake engines of the tests that
drive those loops without a model (tests/unit/test_engine_protocol.py checks both, signatures
included), so that a fake cannot drift from what the real engine takes and answers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .request import FinishReason

if TYPE_CHECKING:
    from .engine import EngineStats, StepOutput
    from .request import Response, SamplingParams


@runtime_checkable
class StepEngine(Protocol):
    def add_request(self, prompt: str | list[int], params: "SamplingParams", request_id: str | None = None, *,
                    tenant: str | None = None, cache_salt: str | None = None) -> str:
        """Queue a request (its id: ``request_id``, or a new one); raises InvalidRequestError."""
        ...

    def has_unfinished(self) -> bool:
        """Whether a request is waiting or running (a caller steps while this holds)."""
        ...

    def step(self) -> list["StepOutput"]:
        """One step: what each request it touched produced."""
        ...

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request that has not finished (no-op for one that has)."""
        ...

    def response(self, request_id: str) -> "Response":
        """The finished request's answer; the engine forgets it."""
        ...

    def stats(self) -> "EngineStats":
        """Counts of this moment (waiting, running, blocks...)."""
        ...
