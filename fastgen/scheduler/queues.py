"""Waiting and running requests and their KV blocks: the bookkeeping every policy shares.

Admission reserves blocks for a given number of tokens; a decode grows by one block at a
time; preemption frees every block of the *most recently admitted* request and puts it
back at the front of the waiting queue, to be recomputed with its generated tokens kept.

With prefix caching, admission first looks up the request's longest run of cached full
blocks (:mod:`fastgen.cache.prefix`), shares them and starts ``num_computed_tokens`` after
them; a block some running request already holds costs nothing, a cached-free one costs one
free block. ``commit`` registers every block as soon as it is full and computed (a prompt
split over many steps becomes reusable chunk by chunk, and so do generated tokens), so a
preempted request's blocks stay cached and its recompute is mostly hits. The block holding
a request's last token is never taken from the cache: that token is always computed, so
the step that completes the tokens has logits to sample from and never writes into a block
another request reads.
"""
from __future__ import annotations

from collections import deque
from typing import Mapping

from ..cache import BlockAllocator, block_hash
from ..config import SchedulerConfig
from ..request import Request, RequestStatus
from .base import Admission, StepPlan


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# prompt_order="deadline": a waiting prompt's TTFT deadline is its arrival plus its length read at
# this rate, the paper's TTFT SLA (DeepSpeed-FastGen's effective throughput, fastgen.bench.metrics)
DEADLINE_PROMPT_TOKENS_PER_S = 512.0


def prompt_deadline(req: Request) -> float:
    """When ``req``'s first token is due under the paper's TTFT SLA (perf_counter seconds)."""
    return req.arrival_time + req.num_prompt_tokens / DEADLINE_PROMPT_TOKENS_PER_S


class RequestQueues:
    """The waiting queue and the running list. ``prompt_order``: "arrival" keeps the waiting queue
    first come, first served; "deadline" keeps new requests in the order of their TTFT deadlines
    (:func:`prompt_deadline`: earliest deadline first, which on one server meets every deadline
    whenever some order can; the SplitFuse scheduler gives the prompts already under way their
    tokens in the same order, merged with this queue's head. A short prompt overtakes longer
    ones that arrived a little earlier; a long one is overtaken only by prompts whose deadlines
    fall before its own, so none waits forever).
    Either way preempted requests go back to the front, and admission is head of line."""

    def __init__(self, allocator: BlockAllocator, block_size: int, prefix_caching: bool = False,
                 prompt_order: str = "arrival") -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.prompt_order = prompt_order
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # in admission order
        self.prefix_queried_tokens = 0            # prompt tokens looked up at first admission
        self.prefix_hit_tokens = 0                # of those, found in the cache

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if self.prompt_order != "deadline":
            self.waiting.append(request)
            return
        due, at = prompt_deadline(request), len(self.waiting)
        # behind every preempted request (the front) and every earlier or equal deadline
        while (at > 0 and self.waiting[at - 1].num_preemptions == 0
               and prompt_deadline(self.waiting[at - 1]) > due):
            at -= 1
        self.waiting.insert(at, request)

    def finish(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED

    def admission(self, num_tokens: int, reserve_blocks: int, hits: list[int] | None = None) -> Admission:
        """Whether blocks for ``num_tokens`` can be had now, leaving ``reserve_blocks`` free
        (no reserve when nothing runs); ``hits`` are cached blocks that cover the first of them."""
        need = blocks_for(num_tokens, self.block_size)
        if need > self.allocator.num_blocks:
            return Admission.TOO_LONG
        cost = need
        if hits:
            cost += self.allocator.share_cost(hits) - len(hits)
        reserve = reserve_blocks if self.running else 0
        return Admission.FITS if self.allocator.can_allocate(cost + reserve) else Admission.KV_BLOCKS

    def cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks that cover ``req``'s first tokens (never its last token's block,
        nor any block when prompt logprobs are still to be collected)."""
        if not self.prefix_caching or req.needs_prompt_logprobs:
            return []
        return self.allocator.lookup(self._hashes(req, (req.num_tokens - 1) // self.block_size))

    def try_admit(self, req: Request, num_tokens: int, reserve_blocks: int) -> bool:
        """Admit the head of the queue with blocks for ``num_tokens`` if :meth:`admission` says
        it fits; cached blocks of its prefix are shared and count as computed."""
        hits = self.cached_prefix(req)
        if self.admission(num_tokens, reserve_blocks, hits) is not Admission.FITS:
            return False
        assert self.waiting[0] is req, "requests are admitted in queue order"
        self.waiting.popleft()
        self.allocator.share(hits)        # first: allocating must not evict a hit
        req.block_ids = hits + self.allocator.allocate(blocks_for(num_tokens, self.block_size) - len(hits))
        req.num_registered_blocks = len(hits)
        req.num_computed_tokens = len(hits) * self.block_size
        if req.num_preemptions == 0:      # a first admission: what the prompt found
            req.num_cached_tokens = req.num_computed_tokens
            if self.prefix_caching:
                self.prefix_queried_tokens += req.num_prompt_tokens
                self.prefix_hit_tokens += req.num_cached_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def _hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """Names of ``req``'s first ``num_blocks`` full blocks (extended as tokens arrive)."""
        hashes, bs = req.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            k = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else req.cache_root,
                                     req.token_ids_slice(k * bs, (k + 1) * bs)))
        return hashes[:num_blocks]

    def register_full_blocks(self, req: Request) -> None:
        """Register every block of ``req`` that is now full and computed."""
        full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if not self.prefix_caching or full <= req.num_registered_blocks:
            return
        hashes = self._hashes(req, full)
        for k in range(req.num_registered_blocks, full):
            self.allocator.register(req.block_ids[k], hashes[k])
        req.num_registered_blocks = full

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
        req.num_registered_blocks = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req.block_ids:
            self.allocator.free(req.block_ids)
        req.block_ids = []


class QueueingScheduler:
    """The Scheduler protocol's bookkeeping half; a policy adds ``schedule()``."""

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int,
                 prefix_caching: bool = False) -> None:
        self.config = config
        self.queues = RequestQueues(allocator, block_size, prefix_caching, config.prompt_order)
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
            self.queues.register_full_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(sampled[chunk.request_id])
                completed.append(req)
        return completed
