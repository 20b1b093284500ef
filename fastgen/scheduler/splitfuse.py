"""Dynamic SplitFuse (DeepSpeed-FastGen): every step aims at one token budget.

Rules, in order, for each step:
1. Every running decode gets its one token (oldest admission first). A decode whose
   next token starts a new KV block takes one; when none is free, the most recently
   admitted running request is preempted (blocks freed, requeued at the front of the
   waiting queue, to be recomputed with its generated tokens kept) until one is.
2. The rest of the budget goes to prompt work in admission order: first requests already
   admitted whose tokens are not all computed (a prompt split by the previous step, or
   a resumed preempted request), then new requests from the waiting queue in arrival
   order. With ``prompt_order="deadline"`` all of it, started or waiting, goes earliest
   TTFT deadline first instead (a short prompt overtakes a long one already under way;
   the waiting queue is kept in deadline order by RequestQueues). A long prompt is
   *split* (its chunk is cut to fill the budget exactly); short prompts are *fused*
   (several fit in one step).
3. A waiting request is admitted only when blocks for all of its tokens are free while
   ``reserve_blocks`` stay free for the running decodes to grow into, or when nothing
   else is running (then it only needs to fit). The queue is served in order: a request
   that does not fit yet blocks those behind it, so none starves.
4. At most ``min(max_seqs, budget_tokens)`` requests run at once, so that the running
   decodes alone never exceed the budget.

Why this never deadlocks: requests longer than the whole pool are rejected at
submission; the oldest running request is never preempted while a newer one runs, so
it always progresses and eventually finishes, freeing its blocks.
"""
from __future__ import annotations

from ..batch import ScheduledChunk
from ..cache import BlockAllocator
from ..config import SchedulerConfig
from ..request import RequestStatus
from .base import StepPlan
from .queues import QueueingScheduler, prompt_deadline


class SplitFuseScheduler(QueueingScheduler):
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int,
                 prefix_caching: bool = False) -> None:
        super().__init__(config, allocator, block_size, prefix_caching)
        self.max_running = min(config.max_seqs, config.budget_tokens)

    def schedule(self) -> StepPlan:
        q = self.queues
        budget = self.config.budget_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        for req in list(q.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or not req.is_decoding:
                continue
            if not q.grow_for_decode(req, preempted):
                continue  # req itself was preempted
            chunks.append(ScheduledChunk(req.request_id, 1))
            budget -= 1

        planned = {c.request_id for c in chunks}
        # rule 2: the prompts already under way and the waiting queue's head, merged. First come,
        # first served: every started prompt (admission order) before the queue. Deadline order:
        # the started ones sorted by TTFT deadline (ties in admission order) against the queue,
        # kept in that order by RequestQueues, earliest first, a preempted request at its head
        # before any. A waiting request that cannot be admitted yet stops admission (head of
        # line, rule 3) but not the started prompts, which hold their blocks.
        started = [r for r in q.running if not r.is_decoding and r.request_id not in planned]
        by_deadline = self.config.prompt_order == "deadline"
        if by_deadline:
            started.sort(key=prompt_deadline)
        i, admitting = 0, True
        while budget > 0:
            head = q.waiting[0] if admitting and q.waiting and len(q.running) < self.max_running else None
            nxt = started[i] if i < len(started) else None
            if head is None and nxt is None:
                break
            if head is not None and (nxt is None or by_deadline and (
                    head.num_preemptions > 0 or prompt_deadline(head) < prompt_deadline(nxt))):
                if not q.try_admit(head, head.num_tokens, self.config.reserve_blocks):
                    admitting = False
                    continue
                req = head
            else:
                req, i = nxt, i + 1
            n = min(req.num_uncomputed_tokens, budget)
            chunks.append(ScheduledChunk(req.request_id, n))
            budget -= n
        return StepPlan(tuple(chunks), tuple(preempted))
