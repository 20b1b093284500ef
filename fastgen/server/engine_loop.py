"""The engine loop: one thread owns the :class:`~fastgen.engine.Engine`; the event loop talks to it
through a queue one way and ``call_soon_threadsafe`` the other.

    event loop (HTTP handlers)                         engine thread
    --------------------------                         -------------
    stream = await loop.submit(prompts, params) --Add--> engine.add_request(...) for each
                                 <--admitted(error)--  (all or none)
    async for delta in stream  <--deliver(deltas)--  engine.step() -> one Delta per output
    stream.close()  (client gone) ------Abort------>  engine.abort(id): its blocks are free now
    await loop.ping(timeout_s)   ------Ping------->  answered between two steps (health checks)

The engine thread loads the model, then loops: take commands (blocking only when it has no
work), end requests past their deadline, run one step, hand that step's deltas to the event
loop in a single callback. It never waits for the event loop. Prompts arrive tokenized, so
tokenization stays off this thread.
"""
from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

from ..engine import EngineStats, StepOutput
from ..engine_protocol import StepEngine
from ..errors import EngineDeadError, FastgenError
from ..request import FinishReason, SamplingParams
from ..telemetry import Record
from .errors import QueueFullError
from .stream import Delta, Stream

__all__ = ["Delta", "EngineLoop", "LoopState", "StepObserver", "StepReport", "Stream"]

log = logging.getLogger(__name__)


class LoopState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"

    def __str__(self) -> str:  # reads as the wire says it: "ready", not "LoopState.READY"
        return self.value


@dataclass(frozen=True)
class _Add:
    requests: list[tuple[str, str | list[int], SamplingParams]]
    stream: Stream
    deadline: float | None  # time.perf_counter() value
    future: asyncio.Future
    tenant: str | None = None        # prefix-cache partition of the API key that sent it
    cache_salt: str | None = None    # the request's own partition within its tenant


@dataclass(frozen=True)
class _Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass(frozen=True)
class _Ping:
    """Answer ``future`` from the engine thread: proof that it is alive and taking commands."""

    future: asyncio.Future


@dataclass(frozen=True)
class _Cut:
    """End every live request now (``FinishReason.ABORT``), telling its stream ``why``."""

    why: str


@dataclass
class _Live:
    """Engine-thread record of one admitted engine request."""

    stream: Stream
    index: int
    deadline: float | None
    scheduled: bool = False


@dataclass(frozen=True)
class StepReport:
    """What the event loop learns after each engine step (or each batch of aborts)."""

    stats: EngineStats
    deltas: list[Delta]          # every choice's delivered deltas, quiet streams' included
    stepped: bool                # an engine step ran (aborts and deadlines also report)
    num_new_tokens: int          # tokens generated in the step, delivered or not
    records: tuple[Record, ...] = ()  # the engine's step records and request events since the last report


StepObserver = Callable[[StepReport], None]


@dataclass
class EngineLoop:
    """Owns an engine in a dedicated thread. Public methods are called on the event loop.

    load: builds the engine (runs on the engine thread, so the thread that loads the model
        is the one that runs it).
    max_queue: sequences that may wait to be scheduled; beyond it :meth:`submit` raises
        :class:`QueueFullError`. ``None`` = unbounded.
    on_step: called on the event loop with a :class:`StepReport` after each step.
    """

    load: Callable[[], StepEngine]
    max_queue: int | None = None
    on_step: StepObserver | None = None
    state: LoopState = LoopState.LOADING
    error: BaseException | None = None
    engine: StepEngine | None = None      # engine thread only (handlers read the server's EngineFacts)
    stats: EngineStats | None = None
    _inbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _live: dict[str, _Live] = field(default_factory=dict)  # engine thread only
    _outbox: list[tuple[Stream, Delta]] = field(default_factory=list)  # engine thread only
    _ids: itertools.count = field(default_factory=itertools.count)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _seen_seq: int = 0                    # engine thread: the last telemetry record handed over
    _streams: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # event loop: submitted streams

    @property
    def num_queued(self) -> int:
        """Submitted sequences (event-loop side) that the engine has not scheduled yet."""
        return sum(s.num_unscheduled for s in list(self._streams))

    @property
    def num_in_flight(self) -> int:
        """Submissions (event-loop side) with a choice that has not delivered its final delta."""
        return sum(1 for s in list(self._streams) if not s.finished)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="fastgen-engine", daemon=True)
        self._thread.start()

    async def submit(self, prompts: list[str | list[int]], params: list[SamplingParams],
                     timeout_s: float | None = None, quiet: bool = False, *, tenant: str | None = None,
                     cache_salt: str | None = None) -> Stream:
        """Queue one engine request per prompt, all or none; raises the engine's
        :class:`InvalidRequestError`, :class:`QueueFullError`, or :class:`EngineDeadError`."""
        if self.state is not LoopState.READY:
            raise EngineDeadError(f"the engine is {self.state}")
        if self.max_queue is not None and self.num_queued >= self.max_queue:
            raise QueueFullError(f"{self.num_queued} sequences are waiting (max_queue={self.max_queue})")
        base = next(self._ids)
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        stream = Stream(self.abort, ids, quiet)
        self._streams.add(stream)
        future = self._loop.create_future()
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        self._inbox.put(_Add(list(zip(ids, prompts, params)), stream, deadline, future, tenant, cache_salt))
        await future
        return stream

    async def wait_loaded(self, poll_s: float = 0.05) -> None:
        """Return once the engine is loaded; raise :class:`EngineDeadError` if loading failed."""
        while self.state is LoopState.LOADING:
            await asyncio.sleep(poll_s)
        if self.state is not LoopState.READY:
            raise EngineDeadError(f"the engine is {self.state}: {self.error}") from self.error

    async def ping(self, timeout_s: float) -> None:
        """A round trip through the engine thread, answered between two steps: returns when the
        thread took the command, raises :class:`EngineDeadError` when the engine is not ready,
        its thread has exited, or it did not answer within ``timeout_s`` (a step that hangs)."""
        if self.state is not LoopState.READY:
            detail = f": {type(self.error).__name__}: {self.error}" if self.error is not None else ""
            raise EngineDeadError(f"the engine is {self.state}{detail}")
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("the engine thread has exited")
        future = self._loop.create_future()
        self._inbox.put(_Ping(future))
        try:
            await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"the engine thread did not answer within {timeout_s:g} s") from None

    def abort(self, request_ids: list[str]) -> None:
        self._inbox.put(_Abort(list(request_ids)))

    def cut(self, why: str) -> None:
        """End every request in flight now; each stream gets a final delta with ``error=why``."""
        self._inbox.put(_Cut(why))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort whatever is left and end the engine thread."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_Stop())
            self._thread.join(timeout_s)
        if self.state is not LoopState.FAILED:
            self.state = LoopState.STOPPED

    # -- event-loop callbacks ----------------------------------------------------------------

    def _admitted(self, cmd: _Add, error: BaseException | None) -> None:
        if error is not None:
            cmd.stream.refuse()
            if not cmd.future.done():
                cmd.future.set_exception(error)
        elif cmd.future.cancelled():  # the caller went away while waiting for admission
            cmd.stream.close()
        else:
            cmd.future.set_result(None)

    @staticmethod
    def _answer(future: asyncio.Future, error: BaseException | None = None) -> None:
        if future.done():  # the caller stopped waiting
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _deliver(self, stats: EngineStats | None, deltas: list[tuple[Stream, Delta]], stepped: bool,
                 num_new_tokens: int, records: tuple[Record, ...] = ()) -> None:
        if stats is not None:
            self.stats = stats
        for stream, delta in deltas:
            stream.push(delta)
        if self.on_step is not None and stats is not None:
            self.on_step(StepReport(stats, [d for _, d in deltas], stepped, num_new_tokens, records))

    def _call(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # -- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self.load()
        except BaseException as e:  # reported through /health and the process exit code
            if isinstance(e, FastgenError):  # the user's mistake: the message says it all
                log.error("loading the engine failed: %s", e)
            else:
                log.exception("loading the engine failed")
            self.error = e
            self.state = LoopState.FAILED
            return
        self.stats = self.engine.stats()
        self.state = LoopState.READY
        try:
            while self._serve_once():
                pass
            self._close_engine()
        except Exception as e:
            log.exception("the engine loop failed; failing every request")
            self.error = e
            self.state = LoopState.FAILED
            for rid, live in self._live.items():
                self._outbox.append((live.stream, Delta(live.index, "", (), FinishReason.ERROR, None)))
            self._live.clear()
            self._flush(None)
            self._close_engine()
            while True:  # answer commands that are still coming so no caller waits forever
                cmd = self._inbox.get()
                if isinstance(cmd, _Stop):
                    return
                if isinstance(cmd, _Add):
                    self._call(self._admitted, cmd, EngineDeadError(f"the engine failed: {e}"))
                elif isinstance(cmd, _Ping):
                    self._call(self._answer, cmd.future, EngineDeadError(f"the engine failed: {e}"))

    def _close_engine(self) -> None:
        """Release what the engine holds beyond this process (a tensor-parallel replica's ranks)."""
        close = getattr(self.engine, "close", None)
        try:
            if close is not None:
                close()
        except Exception:
            log.exception("closing the engine failed")

    def _serve_once(self) -> bool:
        engine = self.engine
        changed = False
        for cmd in self._take_commands(block=not engine.has_unfinished()):
            if isinstance(cmd, _Stop):
                self._abort(list(self._live))
                self._flush(engine.stats())
                return False
            if isinstance(cmd, _Ping):
                self._call(self._answer, cmd.future)
                continue
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Cut):
                self._abort(list(self._live), error=cmd.why)
            else:
                self._abort(cmd.request_ids)
            changed = True
        changed |= self._expire_deadlines()
        outputs = engine.step() if engine.has_unfinished() else []
        self._collect(outputs)
        if changed or outputs:
            self._flush(engine.stats(), bool(outputs), sum(len(o.new_token_ids) for o in outputs))
        return True

    def _take_commands(self, block: bool) -> list:
        cmds = [self._inbox.get()] if block else []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _add(self, cmd: _Add) -> None:
        added: list[str] = []
        try:
            for rid, prompt, params in cmd.requests:
                self.engine.add_request(prompt, params, request_id=rid, tenant=cmd.tenant,
                                        cache_salt=cmd.cache_salt)
                added.append(rid)
        except Exception as e:
            for rid in added:
                self.engine.abort(rid)
                self.engine.response(rid)
            self._call(self._admitted, cmd, e)
            return
        for index, rid in enumerate(added):
            self._live[rid] = _Live(cmd.stream, index, cmd.deadline)
        self._call(self._admitted, cmd, None)

    def _abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT,
               error: str | None = None) -> None:
        for rid in request_ids:
            live = self._live.pop(rid, None)
            if live is None:  # finished already, or never admitted
                continue
            self.engine.abort(rid, reason)
            self._outbox.append((live.stream, Delta(live.index, "", (), reason, self.engine.response(rid),
                                                    error=error)))

    def _expire_deadlines(self) -> bool:
        now = time.perf_counter()
        expired = [rid for rid, live in self._live.items() if live.deadline is not None and now > live.deadline]
        self._abort(expired, FinishReason.TIMEOUT)
        return bool(expired)

    def _collect(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if live.scheduled and out.finish_reason is None and (
                    live.stream.quiet or (not out.new_token_ids and not out.text_delta)):
                continue  # a further prompt chunk, or a token nobody waits for one by one
            live.scheduled = True
            response = None
            reason = None
            if out.finish_reason is not None:
                del self._live[out.request_id]
                response = self.engine.response(out.request_id)
                reason = out.finish_reason
            self._outbox.append((live.stream, Delta(live.index, out.text_delta, out.new_token_ids,
                                                    reason, response, out.logprobs)))

    def _flush(self, stats: EngineStats | None, stepped: bool = False, num_new_tokens: int = 0) -> None:
        deltas, self._outbox = self._outbox, []
        records: tuple[Record, ...] = ()
        events = getattr(self.engine, "events", None)   # an engine without records (a test's fake) has none
        if events is not None:
            records = events.since(self._seen_seq)
            if records:
                self._seen_seq = records[-1].seq
        self._call(self._deliver, stats, deltas, stepped, num_new_tokens, records)
