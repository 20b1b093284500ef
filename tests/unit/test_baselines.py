"""The baseline policies' invariants, model-free: prefill-first and static batching."""
from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from fastgen.cache import BlockAllocator
from fastgen.config import SchedulerConfig
from fastgen.request import Request, SamplingParams
from fastgen.scheduler import PrefillFirstScheduler, StaticScheduler, make_scheduler


def run_policy(cls, jobs, *, budget, max_seqs, block_size, num_blocks, reserve, on_plan):
    """Drive ``cls`` like the engine does; ``on_plan(scheduler, plan, before)`` checks each step."""
    alloc = BlockAllocator(num_blocks)
    sched = cls(SchedulerConfig(budget_tokens=budget, max_seqs=max_seqs, reserve_blocks=reserve), alloc, block_size)
    reqs = []
    for i, (p, o) in enumerate(jobs):
        r = Request(request_id=f"r{i}", prompt_token_ids=list(range(p)), params=SamplingParams(max_new_tokens=o),
                    max_total_tokens=p + o)
        reqs.append(r)
        sched.add(r)
    tokens = itertools.count(1000)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    by_id = {r.request_id: r for r in reqs}
    for _ in range(10_000):
        if not sched.has_work():
            break
        before = {r.request_id: (r.is_decoding, r.num_uncomputed_tokens) for r in sched.running}
        plan = sched.schedule()
        assert plan.chunks, "a policy with work must schedule something"
        on_plan(sched, plan, before)
        sampled = {}
        for c in plan.chunks:
            r = by_id[c.request_id]
            assert r.num_computed_tokens + c.num_tokens <= r.num_tokens
            if r.num_computed_tokens + c.num_tokens == r.num_tokens:
                sampled[c.request_id] = tok = next(tokens)
                outputs[r.request_id].append(tok)
        for r in sched.commit(plan, sampled):            # the policy's own update, as in the engine
            if r.num_tokens >= r.max_total_tokens:
                sched.finish(r)
    else:
        raise AssertionError("no termination")
    assert alloc.num_free_blocks == num_blocks
    for r in reqs:
        assert r.output_token_ids == outputs[r.request_id] and len(r.output_token_ids) == r.params.max_new_tokens
    return reqs


workloads = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(jobs=workloads, budget=st.integers(1, 64), max_seqs=st.integers(1, 6), block_size=st.integers(1, 8),
       spare_blocks=st.integers(0, 20), reserve=st.integers(0, 3))
def test_prefill_first_never_mixes_and_never_splits(jobs, budget, max_seqs, block_size, spare_blocks, reserve):
    largest = max(-(-(p + o) // block_size) for p, o in jobs)
    num_blocks = largest + spare_blocks   # every request fits alone; maybe not all together

    def check(sched, plan, before):
        kinds = set()
        for c in plan.chunks:
            decoding, _ = before.get(c.request_id, (False, None))
            kinds.add("decode" if decoding else "prompt")
            req = next(r for r in sched.running if r.request_id == c.request_id)
            if not decoding:
                assert c.num_tokens == req.num_tokens, "prefill-first processes a prompt whole"
        assert len(kinds) == 1, f"mixed step: {plan}"
        if kinds == {"prompt"} and len(plan.chunks) > 1:
            assert plan.num_tokens <= budget
        assert len(sched.running) <= max_seqs

    run_policy(PrefillFirstScheduler, jobs, budget=budget, max_seqs=max_seqs, block_size=block_size,
               num_blocks=num_blocks, reserve=reserve, on_plan=check)


def test_prefill_first_prefers_waiting_prompts_over_decodes():
    alloc = BlockAllocator(100)
    sched = PrefillFirstScheduler(SchedulerConfig(budget_tokens=64, max_seqs=8, reserve_blocks=0), alloc, 4)
    a = Request(request_id="a", prompt_token_ids=[1] * 5, params=SamplingParams(), max_total_tokens=50)
    sched.add(a)
    [c] = sched.schedule().chunks
    a.num_computed_tokens += c.num_tokens
    a.output_token_ids.append(7)
    b = Request(request_id="b", prompt_token_ids=[1] * 9, params=SamplingParams(), max_total_tokens=50)
    sched.add(b)
    plan = sched.schedule()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("b", 9)]   # a's decode waits
    b.num_computed_tokens += 9
    b.output_token_ids.append(8)
    assert {(c.request_id, c.num_tokens) for c in sched.schedule().chunks} == {("a", 1), ("b", 1)}


@settings(max_examples=150, deadline=None)
@given(jobs=workloads, budget=st.integers(1, 64), max_seqs=st.integers(1, 6), block_size=st.integers(1, 8),
       spare_blocks=st.integers(0, 20))
def test_static_admits_nothing_while_a_batch_runs(jobs, budget, max_seqs, block_size, spare_blocks):
    largest = max(-(-(p + o) // block_size) for p, o in jobs)
    state = {"batch": set()}

    def check(sched, plan, before):
        ids = {c.request_id for c in plan.chunks}
        if before:   # a batch is running: only its members, one decode token each
            assert ids <= set(before) and all(c.num_tokens == 1 for c in plan.chunks)
            assert ids <= state["batch"]
        else:        # a new batch: whole prompts, nothing else
            state["batch"] = ids
            assert all(c.num_tokens == next(r for r in sched.running if r.request_id == c.request_id).num_tokens
                       for c in plan.chunks)
            assert len(ids) <= max_seqs
        assert not any(r.num_preemptions for r in sched.running)

    reqs = run_policy(StaticScheduler, jobs, budget=budget, max_seqs=max_seqs, block_size=block_size,
                      num_blocks=largest + spare_blocks, reserve=0, on_plan=check)
    assert not any(r.num_preemptions for r in reqs)


def test_make_scheduler_knows_every_policy():
    alloc = BlockAllocator(4)
    for name, cls in (("prefill-first", PrefillFirstScheduler), ("static", StaticScheduler)):
        cfg = SchedulerConfig(budget_tokens=8, max_seqs=2, reserve_blocks=0, policy=name)
        assert isinstance(make_scheduler(cfg, alloc, 4), cls)


def test_admission_answers_with_a_reason():
    from fastgen.scheduler.base import Admission
    from fastgen.scheduler.queues import RequestQueues

    q = RequestQueues(BlockAllocator(4), block_size=4)
    assert q.admission(16, 0) is Admission.FITS
    assert q.admission(17, 0) is Admission.TOO_LONG                 # more blocks than the pool has
    r = Request(request_id="a", prompt_token_ids=[1] * 9, params=SamplingParams(), max_total_tokens=20)
    q.add(r)
    assert q.try_admit(r, 9, 0) and len(r.block_ids) == 3
    assert q.admission(8, 0) is Admission.KV_BLOCKS                 # one block left
    assert q.admission(4, 1) is Admission.KV_BLOCKS                 # fits, but not with the reserve
    assert q.admission(4, 0) is Admission.FITS
