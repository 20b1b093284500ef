"""Baseline policies, in the same engine, so that differences come from scheduling alone.

``prefill-first`` is vLLM before chunked prefill: a step is either prompt-only or
decode-only; whenever a waiting request can be admitted, a prompt step runs first, and
each prompt is processed whole. ``static`` is request-level batching: a batch is admitted
only when nothing runs, its prompts are processed together, and it decodes until every
member finishes.

For both, ``budget_tokens`` caps how many prompt tokens one step fuses; a single prompt
longer than the budget still runs, whole and alone (these policies never split prompts).
"""
from __future__ import annotations

from ..batch import ScheduledChunk
from .base import StepPlan
from .queues import QueueingScheduler


class PrefillFirstScheduler(QueueingScheduler):
    def schedule(self) -> StepPlan:
        q = self.queues
        chunks: list[ScheduledChunk] = []
        tokens = 0
        while q.waiting and len(q.running) < self.config.max_seqs:
            req = q.waiting[0]
            n = req.num_tokens
            if chunks and tokens + n > self.config.budget_tokens:
                break
            if not q.try_admit(req, n, self.config.reserve_blocks):
                break
            chunks.append(ScheduledChunk(req.request_id, req.num_uncomputed_tokens))  # after cached blocks
            tokens += req.num_uncomputed_tokens
        if chunks:
            return StepPlan(tuple(chunks))
        preempted: list[str] = []
        for req in list(q.running):
            # a request preempted to make room for an older one has left q.running
            if req in q.running and q.grow_for_decode(req, preempted):
                chunks.append(ScheduledChunk(req.request_id, 1))
        return StepPlan(tuple(chunks), tuple(preempted))


class StaticScheduler(QueueingScheduler):
    """Blocks for a request's whole generation are reserved at admission: never preempts."""

    def schedule(self) -> StepPlan:
        q = self.queues
        if not q.running:
            chunks: list[ScheduledChunk] = []
            tokens = 0
            while q.waiting and len(q.running) < self.config.max_seqs:
                req = q.waiting[0]
                if chunks and tokens + req.num_tokens > self.config.budget_tokens:
                    break
                if not q.try_admit(req, req.max_total_tokens - 1, 0):  # the last token is never fed back
                    break
                chunks.append(ScheduledChunk(req.request_id, req.num_uncomputed_tokens))
                tokens += req.num_uncomputed_tokens
            return StepPlan(tuple(chunks))
        return StepPlan(tuple(ScheduledChunk(r.request_id, 1) for r in q.running))
