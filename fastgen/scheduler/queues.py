"""Waiting and running requests and their KV blocks: the bookkeeping every policy shares.

Admission reserves blocks for a given number of tokens; a decode grows by one block at a
time; preemption frees every block of the *most recently admitted* request and puts it
back at the front of the waiting queue, to be recomputed with its generated tokens kept.
"""
from __future__ import annotations

from collections import deque
from typing import Mapping

from ..cache import BlockAllocator
from ..config import SchedulerConfig
from ..request import Request, RequestStatus
from .base import Admission, StepPlan


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class RequestQueues:
    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # in admission order

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

    def admission(self, num_tokens: int, reserve_blocks: int) -> Admission:
        """Whether blocks for ``num_tokens`` can be had now, leaving ``reserve_blocks`` free
        (no reserve when nothing runs)."""
        need = blocks_for(num_tokens, self.block_size)
        if need > self.allocator.num_blocks:
            return Admission.TOO_LONG
        reserve = reserve_blocks if self.running else 0
        return Admission.FITS if self.allocator.can_allocate(need + reserve) else Admission.KV_BLOCKS

    def try_admit(self, req: Request, num_tokens: int, reserve_blocks: int) -> bool:
        """Admit the head of the queue with blocks for ``num_tokens`` if :meth:`admission` says it fits."""
        if self.admission(num_tokens, reserve_blocks) is not Admission.FITS:
            return False
        need = blocks_for(num_tokens, self.block_size)
        assert self.waiting[0] is req, "requests are admitted in queue order"
        self.waiting.popleft()
        req.block_ids = self.allocator.allocate(need)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def grow_for_decode(self, req: Request, preempted: list[str]) -> bool:
        """Make room for ``req``'s next token; False if ``req`` itself had to be preempted."""
        if len(req.block_ids) * self.block_size > req.num_computed_tokens:
            return True
        while not self.allocator.can_allocate(1):
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        req.block_ids.extend(self.allocator.allocate(1))
        return True

    def preempt(self, req: Request) -> None:
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


class QueueingScheduler:
    """The Scheduler protocol's bookkeeping half; a policy adds ``schedule()``."""

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int) -> None:
        self.config = config
        self.queues = RequestQueues(allocator, block_size)
        self.allocator = allocator
        self.block_size = block_size

    @property
    def waiting(self) -> deque[Request]:
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    @property
    def num_waiting(self) -> int:
        return len(self.queues.waiting)

    @property
    def num_running(self) -> int:
        return len(self.queues.running)

    def has_work(self) -> bool:
        return bool(self.queues.waiting or self.queues.running)

    def add(self, request: Request) -> None:
        self.queues.add(request)

    def finish(self, request: Request) -> None:
        self.queues.finish(request)

    def commit(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[Request]:
        by_id = {r.request_id: r for r in self.queues.running}
        completed = []
        for chunk in plan.chunks:
            req = by_id[chunk.request_id]
            req.num_computed_tokens += chunk.num_tokens
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(sampled[chunk.request_id])
                completed.append(req)
        return completed
