"""Dynamic SplitFuse (DeepSpeed-FastGen): every step aims at one token budget.

Rules, in order, for each step:
1. Every running decode gets its one token (oldest admission first). A decode whose
   next token starts a new KV block takes one; when none is free, the most recently
   admitted running request is preempted (blocks freed, requeued at the front of the
   waiting queue, to be recomputed with its generated tokens kept) until one is.
2. The rest of the budget goes to prompt work in arrival order: first requests already
   admitted whose tokens are not all computed (a prompt split by the previous step, or
   a resumed preempted request), then new requests from the waiting queue. A long
   prompt is *split* (its chunk is cut to fill the budget exactly); short prompts are
   *fused* (several fit in one step).
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

from collections import deque

from ..batch import ScheduledChunk
from ..cache import BlockAllocator
from ..config import SchedulerConfig
from ..request import Request, RequestStatus
from .base import StepPlan, blocks_for


class SplitFuseScheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int) -> None:
        self.config = config
        self.allocator = allocator
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # in admission order
        self.max_running = min(config.max_seqs, config.budget_tokens)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED

    def schedule(self) -> StepPlan:
        budget = self.config.budget_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or not req.is_decoding:
                continue
            if not self._grow_for_decode(req, preempted):
                continue  # req itself was preempted
            chunks.append(ScheduledChunk(req.request_id, 1))
            budget -= 1

        planned = {c.request_id for c in chunks}
        for req in self.running:
            if budget == 0:
                break
            if req.is_decoding or req.request_id in planned:
                continue
            n = min(req.num_uncomputed_tokens, budget)
            chunks.append(ScheduledChunk(req.request_id, n))
            budget -= n

        while budget > 0 and self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            n = min(req.num_uncomputed_tokens, budget)
            chunks.append(ScheduledChunk(req.request_id, n))
            budget -= n
        return StepPlan(tuple(chunks), tuple(preempted))

    # -- KV bookkeeping ---------------------------------------------------------------

    def _admit(self, req: Request) -> bool:
        need = blocks_for(req.num_tokens, self.block_size)
        reserve = self.config.reserve_blocks if self.running else 0
        if not self.allocator.can_allocate(need + reserve):
            return False
        req.block_ids = self.allocator.allocate(need)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def _grow_for_decode(self, req: Request, preempted: list[str]) -> bool:
        """Make room for ``req``'s next token; False if ``req`` had to be preempted."""
        if len(req.block_ids) * self.block_size > req.num_computed_tokens:
            return True
        while not self.allocator.can_allocate(1):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        req.block_ids.extend(self.allocator.allocate(1))
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.allocator.free(req.block_ids)
        req.block_ids = []
