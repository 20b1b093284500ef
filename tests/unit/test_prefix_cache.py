"""Prefix caching: the allocator with shared, content-addressed blocks, and the scheduler that
uses it, checked against a model-free KV "pool" that records which token each slot holds.

The pool stands in for the tensors: whenever a request computes a token, its slot gets
``(token id, position)`` written. A holder reading a block whose contents changed under
it, or a cache hit that names the wrong tokens, shows up as a slot that does not hold the
token the request expects there.
"""
from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fastgen.cache import BlockAllocator, block_hash, root_hash
from fastgen.config import SchedulerConfig
from fastgen.request import Request, RequestStatus, SamplingParams
from fastgen.scheduler import make_scheduler


# -- hashes -------------------------------------------------------------------------------

def test_root_separates_every_key_and_their_boundaries() -> None:
    roots = {root_hash("m", None, None), root_hash("m", "t", None), root_hash("m", "t", "s"),
             root_hash("m", "ts", None), root_hash("m", "", None), root_hash("m", None, ""),
             root_hash("n", None, None), root_hash("m", "t", "s", None)}
    assert len(roots) == 8
    assert root_hash("m", "a", "b") == root_hash("m", "a", "b")


def test_block_hash_chains_parent_and_tokens() -> None:
    r = root_hash("m")
    a = block_hash(r, [1, 2, 3, 4])
    assert a == block_hash(r, [1, 2, 3, 4])
    assert a != block_hash(r, [1, 2, 3, 5])
    assert a != block_hash(root_hash("m", "other tenant"), [1, 2, 3, 4])
    assert block_hash(a, [5, 6]) != block_hash(block_hash(r, [9, 9, 9, 9]), [5, 6])   # the parent counts


# -- allocator ------------------------------------------------------------------------------

def test_registered_block_is_cached_free_after_release_and_shared_on_hit() -> None:
    a = BlockAllocator(4)
    [b] = a.allocate(1)
    assert a.register(b, b"h0")
    a.free([b])
    assert a.num_free_blocks == 4 and a.num_cached_free_blocks == 1 and a.num_used_blocks == 0
    assert a.lookup([b"h0", b"h1"]) == [b]
    assert a.share_cost([b]) == 1
    a.share([b])
    assert a.ref_count(b) == 1 and a.num_cached_free_blocks == 0 and a.num_used_blocks == 1
    a.share([b])                                   # a second holder costs no free block
    assert a.ref_count(b) == 2 and a.num_used_blocks == 1
    a.free([b])
    assert a.ref_count(b) == 1 and a.num_cached_free_blocks == 0
    a.check()


def test_eviction_is_least_recently_released_first_and_never_a_held_block() -> None:
    a = BlockAllocator(3)
    x, y, z = a.allocate(3)
    for blk, h in ((x, b"x"), (y, b"y"), (z, b"z")):
        a.register(blk, h)
    a.free([x, y])          # table order: y (the tail) is released first, so evicted first
    assert not a.can_allocate(3)
    [got] = a.allocate(1)
    assert got == y and a.lookup([b"y"]) == [] and a.lookup([b"x"]) == [x]
    assert a.num_evictions == 1
    [got] = a.allocate(1)
    assert got == x
    with pytest.raises(Exception):
        a.allocate(1)       # z is held: never evicted
    assert a.lookup([b"z"]) == [z]
    a.check()


def test_register_keeps_one_copy_of_a_prefix() -> None:
    a = BlockAllocator(4)
    p, q = a.allocate(2)
    assert a.register(p, b"same")
    assert not a.register(q, b"same")             # computed twice at once: q stays private
    a.free([p, q])
    assert a.num_cached_free_blocks == 1 and a.lookup([b"same"]) == [p]
    a.check()


def test_share_and_register_reject_what_they_cannot_hold() -> None:
    a = BlockAllocator(2)
    [b] = a.allocate(1)
    with pytest.raises(ValueError):
        a.share([b])                               # not registered
    a.free([b])
    with pytest.raises(ValueError):
        a.register(b, b"h")                        # nobody holds it
    with pytest.raises(ValueError):
        a.free([b])                                # double free
    a.check()


class SharingAllocator(RuleBasedStateMachine):
    """Random sequences over a tiny vocabulary (so prefixes repeat) are added, grown and
    released; each writes its tokens into the blocks it computes, as the engine would."""

    BS = 2

    def __init__(self) -> None:
        super().__init__()
        self.a = BlockAllocator(10)
        self.content: dict[int, tuple[int, ...]] = {}      # block -> the tokens written into it
        self.seqs: dict[int, tuple[list[int], list[int], list[bytes]]] = {}   # id -> tokens, table, hashes
        self.ids = itertools.count()

    def _hashes(self, tokens: list[int]) -> list[bytes]:
        out, parent = [], root_hash("model")
        for k in range(len(tokens) // self.BS):
            parent = block_hash(parent, tokens[k * self.BS:(k + 1) * self.BS])
            out.append(parent)
        return out

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def add(self, tokens: list[int]) -> None:
        hashes = self._hashes(tokens)
        hits = self.a.lookup(hashes[:(len(tokens) - 1) // self.BS])
        need = -(-len(tokens) // self.BS) - len(hits)
        if not self.a.can_allocate(self.a.share_cost(hits) + need):
            return
        self.a.share(hits)
        table = hits + self.a.allocate(need)
        for k in range(len(hits), len(table)):              # compute the rest: write its tokens
            self.content[table[k]] = tuple(tokens[k * self.BS:(k + 1) * self.BS])
            if k < len(hashes):
                self.a.register(table[k], hashes[k])
        self.seqs[next(self.ids)] = (tokens, table, hashes)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        _, table, _ = self.seqs.pop(sid)
        self.a.free(table)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tok=st.integers(0, 1))
    def grow(self, data, tok: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens, table, hashes = self.seqs[sid]
        if len(tokens) == len(table) * self.BS:
            if not self.a.can_allocate(1):
                return
            table.extend(self.a.allocate(1))
            self.content[table[-1]] = ()
        tokens.append(tok)
        k = (len(tokens) - 1) // self.BS
        self.content[table[k]] = tuple(tokens[k * self.BS:(k + 1) * self.BS])
        if len(tokens) % self.BS == 0:
            hashes[:] = self._hashes(tokens)
            self.a.register(table[k], hashes[k])

    @invariant()
    def holders_see_their_tokens(self) -> None:
        self.a.check()
        held: dict[int, int] = {}
        for tokens, table, _ in self.seqs.values():
            assert len(set(table)) == len(table)
            for k, blk in enumerate(table):
                held[blk] = held.get(blk, 0) + 1
                want = tuple(tokens[k * self.BS:(k + 1) * self.BS])
                assert self.content[blk] == want, "a block changed under its holder"
        for blk in range(self.a.num_blocks):
            assert self.a.ref_count(blk) == held.get(blk, 0), "reference count != holders"
        assert self.a.num_used_blocks == len(held)


TestSharingAllocator = SharingAllocator.TestCase
TestSharingAllocator.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# -- the scheduler --------------------------------------------------------------------------

def make_request(rid: str, prompt: list[int], output_len: int, root: bytes = b"") -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), params=SamplingParams(max_new_tokens=output_len),
                   max_total_tokens=len(prompt) + output_len, cache_root=root)


class PoolSim:
    """SplitFuse with prefix caching over a slot -> (token, position) map; every chunk is
    checked to read only slots that hold its own earlier tokens."""

    def __init__(self, *, num_blocks: int, block_size: int, budget: int, policy: str = "splitfuse",
                 prefix_caching: bool = True, max_seqs: int = 8) -> None:
        self.bs = block_size
        self.allocator = BlockAllocator(num_blocks)
        cfg = SchedulerConfig(budget_tokens=budget, max_seqs=max_seqs, reserve_blocks=0, policy=policy)
        self.sched = make_scheduler(cfg, self.allocator, block_size, prefix_caching=prefix_caching)
        self.slots: dict[int, tuple[int, int]] = {}
        self.targets: dict[str, int] = {}
        self.reqs: dict[str, Request] = {}
        self.finished: list[str] = []
        self.seen_preemptions: dict[str, int] = {}
        self.resumed_starts: list[int] = []

    def add(self, req: Request) -> None:
        self.reqs[req.request_id] = req
        self.targets[req.request_id] = req.max_total_tokens - req.num_prompt_tokens
        self.sched.add(req)

    def slot(self, req: Request, pos: int) -> int:
        return req.block_ids[pos // self.bs] * self.bs + pos % self.bs

    def step(self) -> None:
        plan = self.sched.schedule()
        sampled = {}
        for c in plan.chunks:
            req = self.reqs[c.request_id]
            start = req.num_computed_tokens
            if self.seen_preemptions.get(req.request_id, 0) != req.num_preemptions:
                self.seen_preemptions[req.request_id] = req.num_preemptions
                self.resumed_starts.append(start)   # where a preempted request's recompute began
            ids = req.token_ids_slice(0, req.num_tokens)
            for pos in range(start):           # what attention reads: this request's own tokens
                assert self.slots.get(self.slot(req, pos)) == (ids[pos], pos), (
                    f"{req.request_id} reads a slot that does not hold its token {pos}")
            for pos in range(start, start + c.num_tokens):
                self.slots[self.slot(req, pos)] = (ids[pos], pos)
            if start + c.num_tokens == req.num_tokens:
                # tokens depend only on the sequence so far, as greedy decoding would
                sampled[c.request_id] = 100 + hash(tuple(ids)) % 7
        for req in self.sched.commit(plan, sampled):
            if req.num_output_tokens >= self.targets[req.request_id]:
                self.sched.finish(req)
                self.finished.append(req.request_id)
        self.allocator.check()
        for req in self.sched.running:
            assert all(self.allocator.ref_count(b) > 0 for b in req.block_ids)

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("did not finish")


SYSTEM = [(5 * i + 1) % 23 for i in range(40)]


def test_shared_prefix_is_computed_once_and_hits_count_whole_blocks() -> None:
    sim = PoolSim(num_blocks=64, block_size=8, budget=16)
    sim.add(make_request("a", SYSTEM + [1, 2, 3], 3))
    sim.run()
    b = make_request("b", SYSTEM + [4, 5], 3)
    sim.add(b)
    sim.step()
    assert b.num_cached_tokens == 40                     # the system prompt's 5 full blocks
    q = sim.sched.queues
    assert (q.prefix_queried_tokens, q.prefix_hit_tokens) == (43 + 42, 40)
    sim.run()


def test_whole_prompt_cached_still_computes_its_last_token() -> None:
    sim = PoolSim(num_blocks=64, block_size=8, budget=64)
    prompt = SYSTEM[:32]                                # exactly 4 blocks
    sim.add(make_request("a", prompt, 2))
    sim.run()
    b = make_request("b", prompt, 2)
    sim.add(b)
    plan = sim.sched.schedule()
    assert b.num_cached_tokens == 24 and [c.num_tokens for c in plan.chunks] == [8]
    assert all(sim.allocator.is_registered(blk) for blk in b.block_ids[:3])
    assert not sim.allocator.is_registered(b.block_ids[3])   # the last block is b's own


def test_tenants_never_share() -> None:
    sim = PoolSim(num_blocks=64, block_size=8, budget=64)
    sim.add(make_request("a", SYSTEM, 2, root=root_hash("m", "tenant-1")))
    sim.run()
    other = make_request("b", SYSTEM, 2, root=root_hash("m", "tenant-2"))
    same = make_request("c", SYSTEM, 2, root=root_hash("m", "tenant-1"))
    sim.add(other)
    sim.add(same)
    sim.run()
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 32


def test_prompt_split_over_steps_is_reusable_chunk_by_chunk() -> None:
    sim = PoolSim(num_blocks=64, block_size=8, budget=16)
    a = make_request("a", SYSTEM + SYSTEM, 2)
    sim.add(a)
    sim.step()                                          # 16 of 80 prompt tokens computed
    assert a.num_computed_tokens == 16
    b = make_request("b", SYSTEM[:20], 1)
    assert sim.sched.queues.cached_prefix(b) == a.block_ids[:2]   # the blocks a filled in step one
    sim.add(b)
    sim.run()
    assert b.num_cached_tokens == 16


def test_preempted_request_recomputes_mostly_from_its_own_cached_blocks() -> None:
    sim = PoolSim(num_blocks=13, block_size=4, budget=16, max_seqs=4)
    long = make_request("long", SYSTEM[:16], 20)
    sim.add(long)
    for _ in range(8):
        sim.step()
    filler = [make_request(f"f{i}", [(i * 3 + j) % 11 + 30 for j in range(9)], 16) for i in range(3)]
    for f in filler:
        sim.add(f)
    sim.run()
    assert sim.resumed_starts, "the workload must preempt"
    assert max(sim.resumed_starts) > 0              # a recompute that started after cached blocks
    assert sorted(sim.finished) == sorted(sim.reqs)
    assert sim.allocator.num_used_blocks == 0


@pytest.mark.parametrize("policy", ["splitfuse", "prefill-first", "static"])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(14, 40))
def test_random_shared_workloads_read_only_their_own_tokens(policy: str, seed: int, num_blocks: int) -> None:
    """Shared prefixes, aborts and preemption under a small pool: every chunk reads slots that
    hold its own tokens, outputs equal the same workload without the cache, nothing leaks."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(40) for _ in range(rng.randrange(0, 20))] for _ in range(3)]
    jobs = [(rng.choice(prefixes) + [rng.randrange(40) for _ in range(rng.randrange(1, 10))],
             rng.randrange(1, 8), rng.randrange(0, 12), rng.random() < 0.15) for _ in range(10)]
    budget = rng.choice([8, 16, 32])
    outputs = {}
    for caching in (True, False):
        sim = PoolSim(num_blocks=num_blocks, block_size=4, budget=budget, policy=policy, prefix_caching=caching)
        pending = sorted(enumerate(jobs), key=lambda j: j[1][2])
        for step in range(3000):
            for i, (prompt, out, arrive, abort) in list(pending):
                if arrive <= step:
                    sim.add(make_request(f"r{i}", prompt, out))
                    pending.remove((i, (prompt, out, arrive, abort)))
            for i, (_, _, arrive, abort) in enumerate(jobs):
                r = sim.reqs.get(f"r{i}")
                if abort and r is not None and step == arrive + 3 and not r.is_finished:
                    sim.sched.finish(r)
            if not pending and not sim.sched.has_work():
                break
            sim.step()
        assert not sim.sched.has_work(), "did not finish"
        sim.allocator.check()
        assert sim.allocator.num_used_blocks == 0
        outputs[caching] = {f"r{i}": sim.reqs[f"r{i}"].output_token_ids for i, job in enumerate(jobs) if not job[3]}
    assert outputs[True] == outputs[False]


def test_drop_cached_forgets_only_unheld_blocks() -> None:
    a = BlockAllocator(4)
    x, y = a.allocate(2)
    a.register(x, b"x")
    a.register(y, b"y")
    a.free([x])
    assert a.drop_cached() == 1
    assert a.lookup([b"x"]) == [] and a.lookup([b"y"]) == [y] and a.num_free_blocks == 3
    a.check()
