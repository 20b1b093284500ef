"""SplitFuseScheduler over a real BlockAllocator, driven by a model-free engine loop.

``Sim`` mimics the bookkeeping of ``fastgen/engine.py`` without a model: after each
``schedule()`` every chunk advances its request's ``num_computed_tokens``; a chunk that
completes all of a request's tokens samples one fake token; a request that reaches its
target output length is finished through ``scheduler.finish``. Every step is checked
against the scheduler's contract (see ``Sim.check_plan``).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings, target
from hypothesis import strategies as st

from fastgen.cache import BlockAllocator
from fastgen.config import SchedulerConfig
from fastgen.request import Request, RequestStatus, SamplingParams
from fastgen.scheduler import SplitFuseScheduler, StepPlan, make_scheduler
from fastgen.scheduler.queues import blocks_for, prompt_deadline


@dataclass(frozen=True)
class Job:
    prompt_len: int
    output_len: int
    arrival_step: int = 0
    abort_step: int | None = None       # the caller cancels it then (engine.abort -> finish)


@dataclass
class Trace:
    """What the test saw of one request, independent of the scheduler's own state."""

    next_pos: int = 0                                   # where the next chunk must start
    epochs: list[list[tuple[int, int]]] = field(default_factory=lambda: [[]])  # (start, n) per admission
    sampled: list[int] = field(default_factory=list)    # fake tokens appended, in order


def make_request(request_id: str, prompt_len: int, output_len: int) -> Request:
    prompt = [(7 * i + 3) % 50 for i in range(prompt_len)]
    return Request(request_id=request_id, prompt_token_ids=prompt,
                   params=SamplingParams(max_new_tokens=output_len),
                   max_total_tokens=prompt_len + output_len)


class Sim:
    def __init__(self, jobs: list[Job], *, budget_tokens: int, max_seqs: int, block_size: int,
                 num_blocks: int, reserve_blocks: int = 0, prompt_order: str = "arrival") -> None:
        self.config = SchedulerConfig(budget_tokens=budget_tokens, max_seqs=max_seqs,
                                      reserve_blocks=reserve_blocks, prompt_order=prompt_order)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = SplitFuseScheduler(self.config, self.allocator, block_size)
        self.jobs = {f"r{i}": job for i, job in enumerate(jobs)}
        self.requests: dict[str, Request] = {}
        self.traces: dict[str, Trace] = {}
        self.added_order: list[str] = []
        self.first_scheduled_order: list[str] = []
        self.plans: list[StepPlan] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self.aborted: set[str] = set()
        self._tokens = itertools.count(1000)

    # -- the loop ---------------------------------------------------------------------------

    def arrivals(self) -> None:
        for rid, job in self.jobs.items():
            if job.arrival_step == self.num_steps:
                req = make_request(rid, job.prompt_len, job.output_len)
                self.requests[rid] = req
                self.traces[rid] = Trace()
                self.added_order.append(rid)
                self.scheduler.add(req)

    def aborts(self) -> None:
        for rid, job in self.jobs.items():
            req = self.requests.get(rid)
            if job.abort_step == self.num_steps and req is not None and not req.is_finished:
                self.scheduler.finish(req)
                self.aborted.add(rid)
                assert req.is_finished and req.block_ids == []

    def step(self) -> StepPlan:
        self.arrivals()
        self.aborts()
        running = [r for r in self.requests.values() if r.status is RequestStatus.RUNNING]
        decoding_before = {r.request_id for r in running if r.is_decoding}
        outputs_before = {rid: list(r.output_token_ids) for rid, r in self.requests.items()}
        prompt_work_before = {r.request_id: r.num_uncomputed_tokens for r in running if not r.is_decoding}
        prompt_work_before.update({r.request_id: r.num_uncomputed_tokens for r in self.scheduler.waiting})
        waiting_before = {r.request_id for r in self.scheduler.waiting}

        plan = self.scheduler.schedule()

        ran_before = set(self.first_scheduled_order)
        self.check_plan(plan, decoding_before, outputs_before)
        self.check_admission_order(plan, ran_before)
        self.check_prompt_work_by_deadline(plan, prompt_work_before, waiting_before)
        self.apply(plan)
        self.plans.append(plan)
        self.num_steps += 1
        return plan

    def apply(self, plan: StepPlan) -> None:
        """The engine's update through the scheduler's own ``commit``: a fake token for every
        chunk that completes its request's tokens; finish at the target length."""
        sampled = {}
        for chunk in plan.chunks:
            req = self.requests[chunk.request_id]
            trace = self.traces[chunk.request_id]
            start = req.num_computed_tokens
            trace.epochs[-1].append((start, chunk.num_tokens))
            trace.next_pos = start + chunk.num_tokens
            if start + chunk.num_tokens == req.num_tokens:
                sampled[chunk.request_id] = tok = next(self._tokens)
                trace.sampled.append(tok)
        completed = self.scheduler.commit(plan, sampled)
        assert [r.request_id for r in completed] == [c.request_id for c in plan.chunks if c.request_id in sampled]
        for chunk in plan.chunks:
            req = self.requests[chunk.request_id]
            assert req.num_computed_tokens == self.traces[chunk.request_id].next_pos
            if chunk.request_id in sampled:
                assert req.output_token_ids[-1] == sampled[chunk.request_id]
                if req.num_output_tokens == self.jobs[chunk.request_id].output_len:
                    self.scheduler.finish(req)

    def run(self, max_steps: int) -> None:
        last_arrival = max((j.arrival_step for j in self.jobs.values()), default=0)
        while self.num_steps <= last_arrival or self.scheduler.has_work():
            assert self.num_steps < max_steps, (
                f"no termination after {max_steps} steps: {self.scheduler.num_running} running, "
                f"{self.scheduler.num_waiting} waiting")
            self.step()

    def step_bound(self) -> int:
        # Each step advances the oldest running request by >= 1 token of work it never loses
        # (it is never preempted while it is the oldest), so total work bounds the steps.
        last_arrival = max((j.arrival_step for j in self.jobs.values()), default=0)
        work = sum(j.prompt_len + j.output_len for j in self.jobs.values())
        return 2 * (last_arrival + work) + 10

    # -- the checks -------------------------------------------------------------------------

    def check_plan(self, plan: StepPlan, decoding_before: set[str],
                   outputs_before: dict[str, list[int]]) -> None:
        cfg = self.config
        chunk_ids = [c.request_id for c in plan.chunks]
        by_id = {c.request_id: c.num_tokens for c in plan.chunks}

        # One token budget, one chunk per request, at most max_seqs running.
        assert plan.num_tokens <= cfg.budget_tokens
        assert len(chunk_ids) == len(set(chunk_ids))
        assert all(c.num_tokens >= 1 for c in plan.chunks)
        assert self.scheduler.num_running <= cfg.max_seqs
        assert self.scheduler.num_running <= cfg.budget_tokens

        # Preemption: the victim forgets its KV, keeps what it generated, goes back to waiting
        # (it may only run again from position 0).
        assert len(plan.preempted_ids) == len(set(plan.preempted_ids))
        for rid in plan.preempted_ids:
            req = self.requests[rid]
            assert req.num_computed_tokens == 0
            assert req.output_token_ids == outputs_before[rid]
            assert req.num_preemptions >= 1
            if rid not in by_id:
                assert req.status is RequestStatus.WAITING
                assert req.block_ids == []
            trace = self.traces[rid]
            trace.next_pos = 0
            trace.epochs.append([])
        self.num_preemptions += len(plan.preempted_ids)

        # Every decode that was running keeps getting exactly one token unless preempted.
        for rid in decoding_before:
            if rid not in plan.preempted_ids:
                assert by_id.get(rid) == 1, f"decode {rid} got {by_id.get(rid)} tokens"

        # Chunks continue exactly where the request's computed tokens end; never past its tokens.
        for c in plan.chunks:
            req = self.requests[c.request_id]
            assert req.status is RequestStatus.RUNNING
            assert req.num_computed_tokens == self.traces[c.request_id].next_pos
            assert c.num_tokens <= req.num_uncomputed_tokens
            if c.request_id not in self.first_scheduled_order:
                self.first_scheduled_order.append(c.request_id)

        # KV: each running request holds what this step writes, and no more than its tokens need;
        # ids are disjoint across requests and add up to the allocator's used count.
        held: list[int] = []
        for req in self.requests.values():
            if req.status is RequestStatus.RUNNING:
                written = req.num_computed_tokens + by_id.get(req.request_id, 0)
                assert blocks_for(written, self.block_size) <= len(req.block_ids), req.request_id
                assert len(req.block_ids) <= blocks_for(req.num_tokens, self.block_size), req.request_id
                held.extend(req.block_ids)
            else:
                assert req.block_ids == [], f"{req.request_id} ({req.status}) holds blocks"
        assert len(held) == len(set(held)), "a block is shared by two requests"
        assert all(0 <= b < self.num_blocks for b in held)
        assert len(held) == self.allocator.num_used_blocks
        assert all(self.allocator.ref_count(b) == 1 for b in held), "a held block's reference count is off"
        self.allocator.check()

    def check_admission_order(self, plan: StepPlan, ran_before: set[str]) -> None:
        """prompt_order="deadline": a request runs for the first time only when no request still
        waiting that never ran (and was never preempted) has an earlier TTFT deadline."""
        if self.config.prompt_order != "deadline":
            return
        fresh = [r for r in self.scheduler.waiting if r.num_preemptions == 0]
        started = [self.requests[c.request_id] for c in plan.chunks if c.request_id not in ran_before]
        for req in started:
            assert all(prompt_deadline(w) >= prompt_deadline(req) for w in fresh), (
                f"{req.request_id} ran before an earlier deadline still waiting")

    def check_prompt_work_by_deadline(self, plan: StepPlan, prompt_work_before: dict[str, int],
                                      waiting_before: set[str]) -> None:
        """prompt_order="deadline": a prompt (under way, or admitted by this step) gets tokens only
        when every one due earlier that was under way or admitted got all of its remaining tokens
        (requests still waiting are held by admission, rule 3; preempted ones by this step's
        decodes; a preempted request readmitted goes first whatever its deadline): a short
        prompt is not held behind a long one that started first."""
        if self.config.prompt_order != "deadline":
            return
        by_id = {c.request_id: c.num_tokens for c in plan.chunks}
        live = {rid: left for rid, left in prompt_work_before.items()
                if rid not in plan.preempted_ids and (rid not in waiting_before or rid in by_id)}
        for rid in live:
            if rid not in by_id or (rid in waiting_before and self.requests[rid].num_preemptions > 0):
                continue
            due = prompt_deadline(self.requests[rid])
            for other, left in live.items():
                if prompt_deadline(self.requests[other]) < due:
                    assert by_id.get(other) == left, (
                        f"{rid} got prompt tokens while {other}, due earlier, got {by_id.get(other)} of {left}")

    def check_finished(self) -> None:
        assert not self.scheduler.has_work()
        assert self.scheduler.num_running == 0 and self.scheduler.num_waiting == 0
        assert self.allocator.num_free_blocks == self.num_blocks, "blocks leaked"
        for rid, req in self.requests.items():
            job, trace = self.jobs[rid], self.traces[rid]
            assert req.is_finished
            assert req.block_ids == []
            assert req.output_token_ids == trace.sampled       # nothing generated was lost
            # Each admission's chunks tile [0, end) contiguously from position 0.
            for epoch in trace.epochs:
                pos = 0
                for start, n in epoch:
                    assert start == pos
                    pos += n
            if rid in self.aborted:
                assert req.num_output_tokens < job.output_len
                continue
            assert req.num_output_tokens == job.output_len
            # The last admission covered every token except the final sampled one (never fed back).
            last = trace.epochs[-1]
            assert last and sum(n for _, n in last) == req.num_tokens - 1
        # Rule 3: the waiting queue is served in arrival order (aborted-while-waiting ones never
        # run); in deadline order check_admission_order held at every step.
        scheduled = set(self.first_scheduled_order)
        if self.config.prompt_order == "arrival":
            assert self.first_scheduled_order == [r for r in self.added_order if r in scheduled]
        assert scheduled | self.aborted == set(self.added_order)


# -- properties over random workloads -----------------------------------------------------------

@st.composite
def workloads(draw: st.DrawFn, *, tight_pool: bool = False,
              aborts: bool = False) -> tuple[list[Job], dict]:
    """Jobs that each fit the pool alone (prompt + output <= capacity), and scheduler knobs.

    With ``tight_pool`` the jobs together need more than the pool holds (and little is held
    in reserve, so decodes run the pool dry); with ``aborts`` some jobs are cancelled midway.
    """
    block_size = draw(st.integers(1, 8))
    num_blocks = draw(st.integers(2, 24))
    capacity = block_size * num_blocks
    max_total = min(capacity, 48)

    def job() -> Job:
        total = draw(st.integers(2, max_total))
        # Tight pools favour short prompts and long outputs: decodes then grow into a full pool.
        prompt_len = draw(st.integers(1, max(1, (total - 1) // 3) if tight_pool else total - 1))
        arrival_step = draw(st.integers(0, 6))
        abort_step = draw(st.none() | st.integers(arrival_step, arrival_step + 30)) if aborts else None
        return Job(prompt_len, total - prompt_len, arrival_step, abort_step)

    jobs = [job() for _ in range(draw(st.integers(1, 8)))]
    while tight_pool and sum(j.prompt_len + j.output_len for j in jobs) <= capacity:
        jobs.append(job())
    knobs = dict(budget_tokens=draw(st.integers(1, 32)), max_seqs=draw(st.integers(1, 8)),
                 block_size=block_size, num_blocks=num_blocks,
                 reserve_blocks=draw(st.integers(0, 1 if tight_pool else 4)),
                 prompt_order=draw(st.sampled_from(["arrival", "deadline"])))
    return jobs, knobs


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_random_workloads_keep_every_invariant(workload: tuple[list[Job], dict]) -> None:
    jobs, knobs = workload
    sim = Sim(jobs, **knobs)
    sim.run(max_steps=sim.step_bound())
    sim.check_finished()
    event(f"preempted: {sim.num_preemptions > 0}")


@settings(max_examples=100, deadline=None)
@given(workloads(tight_pool=True))
def test_tight_pool_completes_every_request(workload: tuple[list[Job], dict]) -> None:
    jobs, knobs = workload
    capacity = knobs["block_size"] * knobs["num_blocks"]
    assert sum(j.prompt_len + j.output_len for j in jobs) > capacity
    assert all(j.prompt_len + j.output_len <= capacity for j in jobs)
    sim = Sim(jobs, **knobs)
    sim.run(max_steps=sim.step_bound())
    sim.check_finished()
    event(f"preempted: {sim.num_preemptions > 0}")
    target(float(sim.num_preemptions), label="preemptions")   # steer towards preempting workloads


@settings(max_examples=100, deadline=None)
@given(workloads(aborts=True))
def test_aborts_at_any_point_free_their_blocks(workload: tuple[list[Job], dict]) -> None:
    jobs, knobs = workload
    sim = Sim(jobs, **knobs)
    sim.run(max_steps=sim.step_bound())
    sim.check_finished()
    event(f"aborted: {len(sim.aborted)}")


def test_tight_pools_do_preempt_and_still_finish() -> None:
    """Across seeded small-pool workloads preemption must actually be exercised."""
    rng = random.Random(1234)
    total_preemptions = 0
    for _ in range(40):
        block_size = rng.randint(1, 4)
        num_blocks = rng.randint(4, 10)
        capacity = block_size * num_blocks
        jobs = []
        for _ in range(rng.randint(3, 6)):
            total = rng.randint(2, capacity)
            prompt_len = rng.randint(1, total - 1)
            jobs.append(Job(prompt_len, total - prompt_len, rng.randint(0, 3)))
        sim = Sim(jobs, budget_tokens=rng.randint(4, 16), max_seqs=rng.randint(2, 6),
                  block_size=block_size, num_blocks=num_blocks, reserve_blocks=rng.randint(0, 1))
        sim.run(max_steps=sim.step_bound())
        sim.check_finished()
        preempted = [r for r in sim.requests.values() if r.num_preemptions]
        assert all(len(r.output_token_ids) == sim.jobs[r.request_id].output_len for r in preempted)
        total_preemptions += sim.num_preemptions
    assert total_preemptions > 0


# -- split and fuse ------------------------------------------------------------------------------

def test_long_prompt_is_split_to_fill_the_budget_exactly() -> None:
    sim = Sim([Job(prompt_len=25, output_len=2)], budget_tokens=8, max_seqs=4,
              block_size=4, num_blocks=16)
    sizes = [sim.step().num_tokens for _ in range(4)]
    assert sizes == [8, 8, 8, 1]                      # the 4th chunk completes the prompt and samples
    req = sim.requests["r0"]
    assert req.num_output_tokens == 1
    assert sim.traces["r0"].epochs == [[(0, 8), (8, 8), (16, 8), (24, 1)]]
    assert len(req.block_ids) == blocks_for(25, 4)   # all prompt blocks were reserved at admission
    sim.run(max_steps=20)
    sim.check_finished()


def test_split_prompt_only_samples_on_its_last_chunk() -> None:
    sim = Sim([Job(prompt_len=10, output_len=3)], budget_tokens=4, max_seqs=1,
              block_size=2, num_blocks=8)
    outputs = []
    for _ in range(3):
        sim.step()
        outputs.append(sim.requests["r0"].num_output_tokens)
    assert outputs == [0, 0, 1]                       # chunks 4, 4, 2


def test_short_prompts_are_fused_into_one_step() -> None:
    sim = Sim([Job(3, 2), Job(2, 2), Job(4, 2), Job(5, 2)], budget_tokens=12, max_seqs=8,
              block_size=4, num_blocks=16)
    plan = sim.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [
        ("r0", 3), ("r1", 2), ("r2", 4), ("r3", 3)]   # the last one is split to fill the budget
    assert plan.num_tokens == 12
    plan = sim.step()
    # Three decodes first (one token each), then the rest of r3's prompt.
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [
        ("r0", 1), ("r1", 1), ("r2", 1), ("r3", 2)]
    sim.run(max_steps=20)
    sim.check_finished()


def test_decodes_and_a_new_prompt_share_a_step() -> None:
    sim = Sim([Job(2, 5), Job(2, 5), Job(20, 2, arrival_step=1)], budget_tokens=8, max_seqs=4,
              block_size=4, num_blocks=16)
    sim.step()                                        # both short prompts
    plan = sim.step()                                 # two decodes + 6 tokens of the long prompt
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("r0", 1), ("r1", 1), ("r2", 6)]
    sim.run(max_steps=40)
    sim.check_finished()


def test_max_seqs_caps_admission() -> None:
    sim = Sim([Job(1, 3) for _ in range(5)], budget_tokens=16, max_seqs=2,
              block_size=4, num_blocks=16)
    plan = sim.step()
    assert [c.request_id for c in plan.chunks] == ["r0", "r1"]
    assert sim.scheduler.num_running == 2 and sim.scheduler.num_waiting == 3
    sim.run(max_steps=30)
    sim.check_finished()


def test_running_requests_never_exceed_the_budget_in_count() -> None:
    # max_seqs larger than the budget: the budget caps running requests so decodes always fit.
    sim = Sim([Job(1, 4) for _ in range(6)], budget_tokens=3, max_seqs=8,
              block_size=4, num_blocks=16)
    sim.step()
    assert sim.scheduler.num_running == 3
    sim.run(max_steps=40)
    sim.check_finished()


# -- KV admission, reserve and preemption ------------------------------------------------------------

def test_admission_reserves_blocks_for_the_whole_prompt() -> None:
    sim = Sim([Job(10, 2)], budget_tokens=3, max_seqs=2, block_size=4, num_blocks=8)
    sim.step()
    assert len(sim.requests["r0"].block_ids) == 3
    assert sim.allocator.num_used_blocks == 3


def test_decode_takes_a_new_block_only_at_a_block_boundary() -> None:
    sim = Sim([Job(3, 5)], budget_tokens=8, max_seqs=1, block_size=4, num_blocks=4)
    blocks = []
    for _ in range(4):
        sim.step()
        req = sim.requests["r0"]
        blocks.append(len(req.block_ids))
    # Prompt of 3 -> 1 block; decodes feed positions 3, 4, 5: position 4 opens block 2.
    assert blocks == [1, 1, 2, 2]


def test_reserve_blocks_hold_back_admission_while_others_run() -> None:
    # 6 blocks of 2. When r1 arrives r0 holds 3 blocks; r1 needs 2 + 3 reserved > 3 free -> it waits.
    sim = Sim([Job(4, 3), Job(4, 1, arrival_step=1)], budget_tokens=16, max_seqs=4,
              block_size=2, num_blocks=6, reserve_blocks=3)
    sim.step()
    plan = sim.step()
    assert [c.request_id for c in plan.chunks] == ["r0"]
    assert sim.scheduler.num_waiting == 1
    sim.run(max_steps=30)                            # r1 runs once r0 is done (nothing else running)
    sim.check_finished()


def test_reserve_is_waived_when_nothing_runs() -> None:
    sim = Sim([Job(10, 2)], budget_tokens=16, max_seqs=4, block_size=2, num_blocks=6,
              reserve_blocks=5)
    plan = sim.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("r0", 10)]


def test_head_of_queue_that_does_not_fit_blocks_those_behind_it() -> None:
    # r1 does not fit next to r0; r2 would, but must not overtake r1.
    sim = Sim([Job(6, 6), Job(12, 2), Job(1, 1)], budget_tokens=32, max_seqs=4,
              block_size=2, num_blocks=8)
    plan = sim.step()
    assert [c.request_id for c in plan.chunks] == ["r0"]
    assert [r.request_id for r in sim.scheduler.waiting] == ["r1", "r2"]
    sim.run(max_steps=60)
    sim.check_finished()


def test_newest_request_is_preempted_and_keeps_its_output() -> None:
    # Pool of 4 blocks of 2 slots. r0 and r1 each hold 2 blocks after their prompts; r0's
    # third decode needs a 3rd block, so r1 (newer) is preempted.
    sim = Sim([Job(3, 4), Job(3, 4)], budget_tokens=16, max_seqs=4, block_size=2, num_blocks=4)
    sim.step()                                        # prompts: both sample their first token
    r0, r1 = sim.requests["r0"], sim.requests["r1"]
    assert len(r0.block_ids) == len(r1.block_ids) == 2
    plan = sim.step()                                 # position 3 fits in block 2 for both
    assert plan.preempted_ids == ()
    out_r1 = list(r1.output_token_ids)
    plan = sim.step()                                 # position 4 needs a new block for each
    assert plan.preempted_ids == ("r1",)
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("r0", 1)]
    assert r1.status is RequestStatus.WAITING and r1.block_ids == [] and r1.num_computed_tokens == 0
    assert r1.output_token_ids == out_r1 and r1.num_preemptions == 1
    assert list(sim.scheduler.waiting) == [r1]
    sim.run(max_steps=40)
    sim.check_finished()
    # r1 was recomputed from its prompt *and* the two tokens it had generated.
    assert sim.traces["r1"].epochs[1][0] == (0, 5)


def test_preempted_requests_go_back_to_the_front_in_admission_order() -> None:
    # Four 1-token prompts fill 4 one-slot blocks; r0's first decode needs a block, so the
    # newest (r3) is preempted.
    sim = Sim([Job(1, 3) for _ in range(4)] + [Job(1, 1, arrival_step=1)], budget_tokens=16,
              max_seqs=8, block_size=1, num_blocks=4)
    sim.step()
    plan = sim.step()
    assert plan.preempted_ids[:1] == ("r3",)
    waiting = [r.request_id for r in sim.scheduler.waiting]
    assert waiting[: len(plan.preempted_ids)] == sorted(plan.preempted_ids)
    assert waiting[-1] == "r4"
    sim.run(max_steps=60)
    sim.check_finished()


# -- finish / abort ---------------------------------------------------------------------------------

def test_finish_frees_blocks_of_a_running_request_mid_prompt() -> None:
    sim = Sim([Job(20, 2)], budget_tokens=4, max_seqs=2, block_size=4, num_blocks=8)
    sim.step()
    req = sim.requests["r0"]
    assert sim.allocator.num_used_blocks == 5
    sim.scheduler.finish(req)
    assert req.is_finished and req.block_ids == []
    assert sim.allocator.num_free_blocks == 8
    assert not sim.scheduler.has_work()
    assert sim.scheduler.schedule().chunks == ()


def test_finish_removes_a_waiting_request_without_touching_blocks() -> None:
    sim = Sim([Job(4, 2), Job(4, 2)], budget_tokens=4, max_seqs=1, block_size=4, num_blocks=4)
    sim.step()
    waiting = sim.requests["r1"]
    used = sim.allocator.num_used_blocks
    sim.scheduler.finish(waiting)
    assert waiting.is_finished and sim.scheduler.num_waiting == 0
    assert sim.allocator.num_used_blocks == used


def test_make_scheduler_builds_splitfuse() -> None:
    sched = make_scheduler(SchedulerConfig(budget_tokens=8, max_seqs=2, reserve_blocks=0),
                           BlockAllocator(4), block_size=4)
    assert isinstance(sched, SplitFuseScheduler)


def test_empty_scheduler_plans_nothing() -> None:
    sched = SplitFuseScheduler(SchedulerConfig(budget_tokens=8, max_seqs=2, reserve_blocks=0),
                               BlockAllocator(4), block_size=4)
    assert not sched.has_work()
    plan = sched.schedule()
    assert plan.chunks == () and plan.preempted_ids == () and plan.num_tokens == 0


@pytest.mark.parametrize("budget_tokens", [1, 2])
def test_tiny_budgets_still_make_progress(budget_tokens: int) -> None:
    sim = Sim([Job(5, 3), Job(2, 4), Job(3, 2, arrival_step=2)], budget_tokens=budget_tokens,
              max_seqs=4, block_size=2, num_blocks=8)
    sim.run(max_steps=sim.step_bound())
    sim.check_finished()


# -- prompt order --------------------------------------------------------------------------------

def test_deadline_order_admits_the_earliest_ttft_deadline_first() -> None:
    """Prompts that arrive together: "arrival" serves them as they came, "deadline" by
    arrival + length / 512 (shortest first here)."""
    lens = [40, 8, 30, 4, 20]
    orders = {}
    for order in ("arrival", "deadline"):
        sim = Sim([Job(n, 2) for n in lens], budget_tokens=16, max_seqs=1, block_size=4, num_blocks=64,
                  prompt_order=order)
        sim.run(max_steps=sim.step_bound())
        sim.check_finished()
        orders[order] = sim.first_scheduled_order
    assert orders["arrival"] == ["r0", "r1", "r2", "r3", "r4"]
    assert orders["deadline"] == ["r3", "r1", "r4", "r2", "r0"]


def test_deadline_order_lets_no_prompt_wait_past_its_deadline_for_later_ones() -> None:
    """A long prompt that arrived first is overtaken only by prompts due before it: once its
    deadline is the earliest, later short prompts queue behind it."""
    sched = make_scheduler(SchedulerConfig(budget_tokens=64, max_seqs=1, reserve_blocks=0, prompt_order="deadline"),
                           BlockAllocator(64), 4)
    long = make_request("long", 512, 1)             # due 1 s after its arrival
    sched.add(long)
    short = make_request("short", 8, 1)
    sched.add(short)                                # due ~16 ms after its own arrival: first
    assert [r.request_id for r in sched.waiting] == ["short", "long"]
    late = make_request("late", 8, 1)
    late.arrival_time = long.arrival_time + 2.0     # arrives after long's deadline
    sched.add(late)
    assert [r.request_id for r in sched.waiting] == ["short", "long", "late"]


def test_deadline_order_lets_a_short_prompt_overtake_a_long_one_under_way() -> None:
    """A short prompt that arrives while a long one is being split goes first in deadline order
    (its TTFT is due much sooner) and waits for the long one's last chunk in arrival order."""
    for order, short_first in (("deadline", True), ("arrival", False)):
        sched = make_scheduler(SchedulerConfig(budget_tokens=16, max_seqs=4, reserve_blocks=0, prompt_order=order),
                               BlockAllocator(64), 4)
        long = make_request("long", 100, 1)
        sched.add(long)
        plan = sched.schedule()
        assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("long", 16)]
        sched.commit(plan, {})
        sched.add(make_request("short", 6, 1))
        plan = sched.schedule()
        got = [(c.request_id, c.num_tokens) for c in plan.chunks]
        if short_first:
            assert got == [("short", 6), ("long", 10)], got
        else:
            assert got == [("long", 16)], got


def test_preempted_requests_stay_ahead_of_new_ones_in_deadline_order() -> None:
    sched = make_scheduler(SchedulerConfig(budget_tokens=64, max_seqs=4, reserve_blocks=0, prompt_order="deadline"),
                           BlockAllocator(64), 4)
    back = make_request("back", 40, 4)
    back.num_preemptions = 1                        # as RequestQueues.preempt leaves it
    sched.queues.waiting.appendleft(back)
    sched.add(make_request("new", 2, 1))
    assert [r.request_id for r in sched.waiting] == ["back", "new"]
