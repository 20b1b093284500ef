"""What the event loop reads of one submission: its :class:`Delta` records and the :class:`Stream`
that yields them. A stream owns its own counts (choices unscheduled, unfinished); its owner, the
:class:`~fastgen.server.engine_loop.EngineLoop`, pushes deltas in and asks for those counts."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from ..request import FinishReason, Response, TokenLogprob


@dataclass(frozen=True)
class Delta:
    """What one engine request (one *choice* of a submission) produced since its last delta.

    The first delta of a choice may be empty: it says the engine has scheduled it. The
    last carries ``finish_reason`` (a :class:`FinishReason`, an enum until JSON is written) and the engine's
    :class:`Response` (``None`` only when the engine itself failed). ``logprobs`` are those of
    ``token_ids``, when the request asked for them. A quiet stream's deltas do not add up to
    the whole answer: read it from the last delta's ``response``. ``error`` says why a final
    delta ended the request when the server, not the engine, ended it (a shutdown cut).
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    response: Response | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None


class Stream:
    """The deltas of one submission's engine requests, in the order the engine produced them.

    Iterate it to the end, or call :meth:`close` to abort what has not finished. A *quiet*
    stream (for answers that are not streamed) skips the deltas between a choice's first and
    last, which spares the event loop a wake-up per token.
    """

    def __init__(self, abort: Callable[[list[str]], None], request_ids: list[str], quiet: bool = False) -> None:
        self.request_ids = request_ids
        self.quiet = quiet  # only the first (scheduled) and final delta of each choice are delivered
        self._abort = abort
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))
        self._unscheduled = set(range(len(request_ids)))

    @property
    def finished(self) -> bool:
        return not self._unfinished

    @property
    def num_unscheduled(self) -> int:
        """Choices the engine has not scheduled yet (the owner sums these for its queue length)."""
        return len(self._unscheduled)

    def __aiter__(self) -> "Stream":
        return self

    async def __anext__(self) -> Delta:
        if not self._unfinished and self._queue.empty():
            raise StopAsyncIteration
        return await self._queue.get()

    def close(self) -> None:
        """Abort every choice that has not finished (idempotent)."""
        if self._unfinished:
            self._abort([self.request_ids[i] for i in self._unfinished])

    # -- called on the event loop by the owner --------------------------------------------

    def push(self, delta: Delta) -> None:
        """Deliver ``delta``: its choice is scheduled now, and finished if the delta is final."""
        self._unscheduled.discard(delta.index)
        if delta.finish_reason is not None:
            self._unfinished.discard(delta.index)
        self._queue.put_nowait(delta)

    def refuse(self) -> None:
        """The submission was not admitted: no choice will be scheduled or deliver anything."""
        self._unscheduled.clear()
        self._unfinished.clear()
