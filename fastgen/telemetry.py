"""Per-step records and per-request lifecycle events: what the engine did, one small immutable
record at a time, in a bounded ring buffer.

The engine appends a :class:`StepRecord` after each forward pass and a :class:`RequestEvent`
when a request arrives, is first scheduled, produces its first token and finishes. Readers
(the server's dashboard feed, ``--trace-file``, ``fastgen bench --trace-file``) take the records
newer than the last sequence number they saw with :meth:`EventLog.since`, on the engine's
thread; the server hands them over to its event loop as tuples of frozen records. Nothing
here does I/O, and with nobody reading the cost is one append per step (measured in
docs/reliability.md).

Times are ``time.perf_counter()`` values, as in :class:`~fastgen.request.Timings`;
:func:`to_json` adds wall-clock seconds (``wall_s``) for files and browsers.
"""
from __future__ import annotations

import enum
import itertools
import json
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import IO, Any, Iterable

from .request import FinishReason

DEFAULT_CAPACITY = 4096

# perf_counter -> wall clock, fixed once per process so that every record converts alike
_WALL_OFFSET_S = time.time() - time.perf_counter()


class EventKind(str, enum.Enum):
    ARRIVED = "arrived"              # queued by add_request
    SCHEDULED = "scheduled"          # first admitted into a step
    FIRST_TOKEN = "first_token"      # its first generated token was sampled
    FINISHED = "finished"            # ended, with a finish reason (stop, length, abort, timeout, error)


@dataclass(frozen=True, slots=True)
class RequestProgress:
    """Where one request of a step stood after it: prompt tokens computed and tokens generated."""

    request_id: str
    prompt_tokens: int
    computed_tokens: int     # KV positions filled (prompt and generated), after the step
    output_tokens: int


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One forward pass. ``prompt_tokens + decode_tokens <= budget_tokens``; the rest of the
    budget went unused. KV block counts are taken after the step and add up to the pool:
    ``kv_blocks_used`` (held by requests), ``kv_blocks_cached`` (held by nobody, kept for
    prefix-cache hits, evicted when needed) and ``kv_blocks_free``."""

    seq: int
    time_s: float
    step_time_s: float
    budget_tokens: int
    prompt_tokens: int
    decode_tokens: int
    num_seqs: int
    num_waiting: int
    num_running: int
    num_preempted: int       # preempted when this step was planned
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    failed: bool             # the forward pass raised; its requests ended with an error
    progress: tuple[RequestProgress, ...]

    kind = "step"


@dataclass(frozen=True, slots=True)
class RequestEvent:
    seq: int
    time_s: float
    event: EventKind
    request_id: str
    prompt_tokens: int
    output_tokens: int
    max_new_tokens: int
    finish_reason: FinishReason | None = None
    ttft_s: float | None = None      # FIRST_TOKEN: arrival -> first token
    e2e_s: float | None = None       # FINISHED: arrival -> finish

    kind = "request"


Record = StepRecord | RequestEvent


class EventLog:
    """A bounded ring of records with increasing ``seq`` numbers (the engine thread's).

    ``capacity=0`` turns recording off (``since`` then returns nothing). A reader that falls
    more than ``capacity`` records behind loses the oldest ones; ``since`` says so through
    the gap between the ``seq`` it asked after and the first it got.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self.enabled = capacity > 0
        self._ring: deque[Record] = deque(maxlen=max(1, capacity))
        self._seq = itertools.count(1)

    @property
    def last_seq(self) -> int:
        return self._ring[-1].seq if self._ring else 0

    def next_seq(self) -> int:
        return next(self._seq)

    def append(self, record: Record) -> None:
        self._ring.append(record)

    def since(self, seq: int) -> tuple[Record, ...]:
        """Records with ``seq`` greater than ``seq``, oldest first."""
        ring = self._ring
        if not ring or ring[-1].seq <= seq:
            return ()
        if ring[0].seq > seq:
            return tuple(ring)
        out = []
        for r in reversed(ring):
            if r.seq <= seq:
                break
            out.append(r)
        out.reverse()
        return tuple(out)


def to_json(record: Record) -> dict[str, Any]:
    """A record as a JSON object: ``kind`` first, enums as their values, ``wall_s`` added."""
    out: dict[str, Any] = {"kind": record.kind}
    for f in fields(record):
        v = getattr(record, f.name)
        if isinstance(v, enum.Enum):
            v = v.value
        elif f.name == "progress":
            v = [[p.request_id, p.prompt_tokens, p.computed_tokens, p.output_tokens] for p in v]
        out[f.name] = v
    out["wall_s"] = round(record.time_s + _WALL_OFFSET_S, 6)
    return out


class TraceWriter:
    """Writes records as JSON lines (``--trace-file``), flushed after each batch (one per step),
    so that a reader (``tail -f``) or a killed process loses at most the step in hand."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] = open(path, "w", encoding="utf-8")
        self.num_written = 0

    def write(self, records: Iterable[Record]) -> None:
        f = self._file
        for r in records:
            f.write(json.dumps(to_json(r), separators=(",", ":")) + "\n")
            self.num_written += 1
        f.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_trace(path: str) -> list[dict[str, Any]]:
    """The records of a trace file (JSON lines), skipping a torn last line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out
