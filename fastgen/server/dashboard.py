"""The live dashboard: ``GET /dashboard`` (one self-contained HTML page, package data) and
``GET /dashboard/feed`` (server-sent events of the engine's step records and request events).

The engine thread hands its new records to the event loop with each step report
(:class:`~fastgen.server.engine_loop.StepReport.records`); :class:`Telemetry` keeps the last
few hundred in a ring for pages that connect later, the requests in flight for their table,
and fans records out to subscribers, each behind a bounded queue (a slow page loses records,
it never slows the engine). ``--trace-file`` writes the same records as JSON lines.

The page is open (it holds no data); the feed is behind ``--api-key`` like every other route.
The page sends the key in the ``Authorization`` header of a ``fetch`` (not a query string, so
it never reaches a log): it takes it from the page's fragment (``/dashboard#key=KEY``, which
browsers do not send) or asks for it once and keeps it in the tab's ``sessionStorage``.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from importlib import resources
from typing import Any, AsyncIterator

from ..telemetry import EventKind, Record, RequestEvent, StepRecord, TraceWriter, to_json

log = logging.getLogger(__name__)

RING_RECORDS = 600          # records a page that connects gets at once (about a minute of steps)
SUBSCRIBER_QUEUE = 2048     # records one slow page may fall behind before it loses them
HEARTBEAT_S = 10.0


def dashboard_html() -> str:
    return resources.files("fastgen.server").joinpath("static/dashboard.html").read_text(encoding="utf-8")


class Telemetry:
    """Event-loop side of the records: ring, requests in flight, subscribers, trace file."""

    def __init__(self, info: dict[str, Any], trace_path: str | None = None) -> None:
        self.info = info                       # static facts for the page (model, budget, blocks)
        self._ring: deque[Record] = deque(maxlen=RING_RECORDS)
        self._live: dict[str, dict[str, Any]] = {}
        self._subscribers: set[asyncio.Queue] = set()
        self.num_dropped = 0
        self.trace = TraceWriter(trace_path) if trace_path else None

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def feed(self, records: tuple[Record, ...]) -> None:
        if not records:
            return
        if self.trace is not None:
            self.trace.write(records)
        for r in records:
            if isinstance(r, RequestEvent):
                self._track(r)
            elif isinstance(r, StepRecord):
                for p in r.progress:
                    live = self._live.get(p.request_id)
                    if live is not None:
                        live["computed_tokens"], live["output_tokens"] = p.computed_tokens, p.output_tokens
        self._ring.extend(records)   # converted to JSON only when a page asks (snapshot)
        if not self._subscribers:
            return
        objs = [to_json(r) for r in records]
        for q in self._subscribers:
            for o in objs:
                if q.full():
                    self.num_dropped += 1
                    break
                q.put_nowait(o)

    def _track(self, e: RequestEvent) -> None:
        if e.event is EventKind.FINISHED:
            self._live.pop(e.request_id, None)
        elif e.event is EventKind.ARRIVED:
            self._live[e.request_id] = {"request_id": e.request_id, "prompt_tokens": e.prompt_tokens,
                                        "computed_tokens": 0, "output_tokens": e.output_tokens,
                                        "max_new_tokens": e.max_new_tokens, "wall_s": to_json(e)["wall_s"]}

    def snapshot(self) -> dict[str, Any]:
        return {"kind": "hello", **self.info, "in_flight": list(self._live.values()), "recent": [to_json(r) for r in self._ring]}

    async def subscribe(self) -> AsyncIterator[str]:
        """SSE lines: a ``hello`` snapshot, then every record as it comes, with comments as heartbeats."""
        q: asyncio.Queue = asyncio.Queue(maxsize=SUBSCRIBER_QUEUE)
        self._subscribers.add(q)
        try:
            yield _sse(self.snapshot())
            while True:
                try:
                    obj = await asyncio.wait_for(q.get(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                batch = [obj]
                while not q.empty() and len(batch) < 256:
                    batch.append(q.get_nowait())
                yield "".join(_sse(o) for o in batch)
        finally:
            self._subscribers.discard(q)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
