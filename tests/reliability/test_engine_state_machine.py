"""A hypothesis state machine over a real engine (tiny random-weight Llama, a KV pool small enough
that preemption is common): requests are added, aborted, stepped and preempted at random, and
after every operation

- no KV block is leaked or owned twice (the allocator's view and the requests' view agree),
- every request ends exactly once (one FINISHED event in the engine's own records, and one
  finish seen by the caller),
- a request that ran to its end produced exactly the greedy tokens it produces alone.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fastgen.engine import Engine
from fastgen.request import FinishReason, RequestStatus, SamplingParams
from fastgen.telemetry import EventKind, RequestEvent

OPTIONS = dict(dtype="float32", num_blocks=10, block_size=4, budget_tokens=12, max_seqs=4,
               reserve_blocks=1, num_threads=1)


@pytest.fixture(scope="module")
def engines(tiny_model):
    main = Engine.from_pretrained(tiny_model, **OPTIONS)
    alone = Engine(main.config, main.model, main.tokenizer, main.model_config)  # same weights, own pool
    return main, alone


_reference: dict[tuple, tuple[int, ...]] = {}


def greedy_alone(engine: Engine, prompt: tuple[int, ...], max_new: int) -> tuple[int, ...]:
    key = (prompt, max_new)
    if key not in _reference:
        rid = engine.add_request(list(prompt), SamplingParams(max_new_tokens=max_new, do_sample=False,
                                                               ignore_eos=True))
        for _ in range(4 * (len(prompt) + max_new)):  # bounded: alone, it needs far fewer steps
            if not engine.has_unfinished():
                break
            engine.step()
        assert not engine.has_unfinished(), "a request alone did not finish"
        _reference[key] = engine.response(rid).token_ids
    return _reference[key]


def test_engine_state_machine(engines):
    main, alone = engines
    vocab = main.model_config.vocab_size

    class EngineMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.engine = main
            for rid in list(main._requests):  # a previous example's leftovers
                main.abort(rid)
                main.response(rid)
            assert not main.has_unfinished() and main.allocator.num_used_blocks == 0
            main.allocator.drop_cached()     # each example starts from an empty prefix cache
            self.seen_seq = main.events.last_seq
            self.finished_events: dict[str, int] = {}
            self.live: dict[str, tuple[tuple[int, ...], int]] = {}
            self.finishes: dict[str, int] = {}
            self.aborted: set[str] = set()
            self.num = 0

        @precondition(lambda self: len(self.live) < 6)
        @rule(prompt_len=st.integers(1, 18), max_new=st.integers(1, 10), seed=st.integers(0, 2**16),
              shared=st.integers(0, 12))
        def add(self, prompt_len: int, max_new: int, seed: int, shared: int) -> None:
            rng = random.Random(seed)
            # the first ``shared`` tokens are common to every request: prefix-cache hits and shared blocks
            prompt = (tuple(range(1, shared + 1)) + tuple(rng.randrange(vocab) for _ in range(prompt_len)))[:18]
            rid = f"r{self.num}"
            self.num += 1
            self.engine.add_request(list(prompt), SamplingParams(max_new_tokens=max_new, do_sample=False,
                                                                 ignore_eos=True), request_id=rid)
            self.live[rid] = (prompt, max_new)

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def abort(self, data) -> None:
            rid = data.draw(st.sampled_from(sorted(self.live)))
            self.engine.abort(rid)
            self._ended(rid, aborted=True)

        @precondition(lambda self: self.engine.scheduler.running)
        @rule()
        def preempt(self) -> None:
            sched = self.engine.scheduler
            sched.queues.preempt(sched.running[-1])  # what the scheduler does under KV pressure

        @precondition(lambda self: self.engine.has_unfinished())
        @rule(times=st.integers(1, 4))
        def step(self, times: int) -> None:
            for _ in range(times):
                for out in self.engine.step():
                    if out.finish_reason is not None:
                        assert out.finish_reason is FinishReason.LENGTH, out
                        self._ended(out.request_id)

        def _ended(self, rid: str, aborted: bool = False) -> None:
            self.finishes[rid] = self.finishes.get(rid, 0) + 1
            prompt, max_new = self.live.pop(rid)
            r = self.engine.response(rid)
            if aborted:
                assert r.finish_reason is FinishReason.ABORT
                want = greedy_alone(alone, prompt, max_new)
                assert r.token_ids == want[:len(r.token_ids)]  # what it had so far is the same prefix
            else:
                assert r.token_ids == greedy_alone(alone, prompt, max_new), (rid, r.num_preemptions)

        @invariant()
        def blocks_are_owned_once_and_none_leak(self) -> None:
            e = self.engine
            holders: dict[int, int] = {}
            for r in e._requests.values():
                if not r.is_finished:
                    assert len(set(r.block_ids)) == len(r.block_ids), "a block twice in one table"
                    for b in r.block_ids:
                        holders[b] = holders.get(b, 0) + 1
            for b in range(e.allocator.num_blocks):   # shared prefix blocks have several holders
                assert e.allocator.ref_count(b) == holders.get(b, 0), "leaked or unaccounted block"
            assert e.allocator.num_used_blocks == len(holders)
            e.allocator.check()                       # free and cached-free lists disjoint, none lost
            for r in e._requests.values():
                if r.status is RequestStatus.WAITING:
                    assert not r.block_ids

        @invariant()
        def every_request_ends_exactly_once(self) -> None:
            assert all(n == 1 for n in self.finishes.values()), self.finishes
            assert not set(self.finishes) & set(self.live)
            new = self.engine.events.since(self.seen_seq)
            assert not new or new[0].seq == self.seen_seq + 1, "the ring lost records"
            for rec in new:
                if isinstance(rec, RequestEvent) and rec.event is EventKind.FINISHED:
                    self.finished_events[rec.request_id] = self.finished_events.get(rec.request_id, 0) + 1
            if new:
                self.seen_seq = new[-1].seq
            assert self.finished_events == {rid: 1 for rid in self.finishes}

    EngineMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None,
                                               suppress_health_check=list(HealthCheck))
    EngineMachine.TestCase().runTest()
    assert main.stats().prefix_hit_tokens > 0, "the examples never shared a cached prefix"
