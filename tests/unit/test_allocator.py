"""BlockAllocator: answers before it commits, fails without side effects, never hands an id out twice."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 precondition, rule)

from fastgen.cache import BlockAllocator, OutOfBlocksError


def num_referenced(a: BlockAllocator) -> int:
    """Blocks with a reference, counted from the reference counts: a second account, kept apart
    from the free lists that ``num_free_blocks`` (and so ``num_used_blocks``) is derived from."""
    return sum(1 for i in range(a.num_blocks) if a.ref_count(i) > 0)


def snapshot(a: BlockAllocator) -> tuple[int, int]:
    """(free blocks by the free lists, referenced blocks by the reference counts)."""
    return a.num_free_blocks, num_referenced(a)


# -- construction ---------------------------------------------------------------------

@pytest.mark.parametrize("num_blocks", [0, -1])
def test_rejects_non_positive_pool(num_blocks: int) -> None:
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks)


def test_fresh_pool_is_all_free() -> None:
    a = BlockAllocator(5)
    assert snapshot(a) == (5, 0)
    assert a.num_blocks == 5


# -- can_allocate / allocate ------------------------------------------------------------

def test_can_allocate_answers_without_committing() -> None:
    a = BlockAllocator(4)
    assert a.can_allocate(0)
    assert a.can_allocate(4)
    assert not a.can_allocate(5)
    assert snapshot(a) == (4, 0)          # asking changed nothing
    a.allocate(3)
    assert a.can_allocate(1)
    assert not a.can_allocate(2)
    assert snapshot(a) == (1, 3)


def test_can_allocate_rejects_negative_counts() -> None:
    assert not BlockAllocator(4).can_allocate(-1)


def test_allocate_negative_count_raises_and_changes_nothing() -> None:
    a = BlockAllocator(4)
    with pytest.raises((ValueError, OutOfBlocksError)):
        a.allocate(-1)
    assert snapshot(a) == (4, 0)


def test_allocate_hands_out_distinct_in_range_ids() -> None:
    a = BlockAllocator(8)
    ids = a.allocate(3) + a.allocate(5)
    assert sorted(ids) == list(range(8))
    assert snapshot(a) == (0, 8)


def test_allocate_zero_is_a_no_op() -> None:
    a = BlockAllocator(3)
    assert a.allocate(0) == []
    assert snapshot(a) == (3, 0)


def test_allocate_too_many_raises_and_changes_nothing() -> None:
    a = BlockAllocator(4)
    held = a.allocate(3)
    with pytest.raises(OutOfBlocksError):
        a.allocate(2)
    assert snapshot(a) == (1, 3)
    # The one free block is still usable and is not one of the held ids.
    last = a.allocate(1)
    assert set(last).isdisjoint(held)
    with pytest.raises(OutOfBlocksError):
        a.allocate(1)
    assert snapshot(a) == (0, 4)


def test_out_of_blocks_is_a_runtime_error() -> None:
    # Callers that catch RuntimeError (the engine's step loop) also see this one.
    assert issubclass(OutOfBlocksError, RuntimeError)


# -- free ---------------------------------------------------------------------------------

def test_free_returns_blocks_for_reuse() -> None:
    a = BlockAllocator(2)
    ids = a.allocate(2)
    a.free(ids)
    assert snapshot(a) == (2, 0)
    assert sorted(a.allocate(2)) == sorted(ids)


def test_double_free_is_rejected_and_releases_nothing() -> None:
    a = BlockAllocator(4)
    ids = a.allocate(2)
    a.free(ids[:1])
    before = snapshot(a)
    with pytest.raises(ValueError):
        a.free(ids)                       # ids[0] is already free; ids[1] must stay held
    assert snapshot(a) == before
    a.free(ids[1:])                       # still allocated, so this succeeds
    assert snapshot(a) == (4, 0)


def test_duplicate_id_in_one_call_is_rejected_and_releases_nothing() -> None:
    a = BlockAllocator(4)
    ids = a.allocate(2)
    with pytest.raises(ValueError):
        a.free([ids[0], ids[1], ids[0]])
    assert snapshot(a) == (2, 2)
    a.free(ids)
    assert snapshot(a) == (4, 0)


@pytest.mark.parametrize("foreign", [-1, 4, 100])
def test_foreign_id_is_rejected_and_releases_nothing(foreign: int) -> None:
    a = BlockAllocator(4)
    ids = a.allocate(3)
    with pytest.raises(ValueError):
        a.free(ids[:2] + [foreign])
    assert snapshot(a) == (1, 3)
    a.free(ids)
    assert snapshot(a) == (4, 0)


def test_never_allocated_in_range_id_is_rejected() -> None:
    a = BlockAllocator(4)
    held = a.allocate(2)
    free_id = next(i for i in range(4) if i not in held)
    with pytest.raises(ValueError):
        a.free([held[0], free_id])
    assert snapshot(a) == (2, 2)


def test_free_empty_list_is_a_no_op() -> None:
    a = BlockAllocator(3)
    a.allocate(1)
    a.free([])
    assert snapshot(a) == (2, 1)


# -- random operation sequences -------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 16),
       ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "bad_free"]), st.integers(0, 20)),
                    max_size=60))
def test_random_op_sequences_keep_accounting(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    a = BlockAllocator(num_blocks)
    owned: list[list[int]] = []          # one entry per successful allocate call
    released: set[int] = set()           # ids freed at least once (for double-free attempts)
    for op, k in ops:
        held = {i for group in owned for i in group}
        before = snapshot(a)
        if op == "alloc":
            fits = a.can_allocate(k)
            assert fits == (k <= num_blocks - len(held))
            assert snapshot(a) == before
            if fits:
                ids = a.allocate(k)
                assert len(ids) == k == len(set(ids))
                assert set(ids).isdisjoint(held), "an id was handed out twice"
                assert all(0 <= i < num_blocks for i in ids)
                owned.append(ids)
                released -= set(ids)
            else:
                with pytest.raises(OutOfBlocksError):
                    a.allocate(k)
                assert snapshot(a) == before
        elif op == "free" and owned:
            ids = owned.pop(k % len(owned))
            a.free(ids)
            released |= set(ids)
        elif op == "bad_free":
            stale = sorted(released - held)
            bad = stale[k % len(stale)] if stale and k % 2 else num_blocks + k
            mixed = [i for group in owned for i in group][:1] + [bad]
            with pytest.raises(ValueError):
                a.free(mixed)
            assert snapshot(a) == before
        held = {i for group in owned for i in group}
        assert all(a.ref_count(i) == 1 for i in held)
        assert a.num_used_blocks == num_referenced(a) == len(held)
        a.check()
    for ids in owned:
        a.free(ids)
    assert snapshot(a) == (num_blocks, 0)


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator against a model: the set of ids each owner holds."""

    groups = Bundle("groups")

    @initialize(num_blocks=st.integers(1, 12))
    def setup(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.held: set[int] = set()
        self.freed: set[int] = set()

    @rule(target=groups, n=st.integers(0, 6))
    def allocate(self, n: int) -> list[int]:
        free_before = self.allocator.num_free_blocks
        assert self.allocator.can_allocate(n) == (n <= free_before)
        if n > free_before:
            with pytest.raises(OutOfBlocksError):
                self.allocator.allocate(n)
            assert self.allocator.num_free_blocks == free_before
            return []
        ids = self.allocator.allocate(n)
        assert len(set(ids)) == n
        assert self.held.isdisjoint(ids), "an id was handed out twice"
        self.held |= set(ids)
        self.freed -= set(ids)
        return ids

    @rule(ids=consumes(groups))
    def free(self, ids: list[int]) -> None:
        self.allocator.free(ids)
        self.held -= set(ids)
        self.freed |= set(ids)

    @precondition(lambda self: bool(self.freed))
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        stale = data.draw(st.sampled_from(sorted(self.freed)))
        extra = sorted(self.held)[:1]
        before = snapshot(self.allocator)
        with pytest.raises(ValueError):
            self.allocator.free(extra + [stale])
        assert snapshot(self.allocator) == before

    @rule(foreign=st.one_of(st.integers(max_value=-1), st.integers(min_value=12)))
    def foreign_free(self, foreign: int) -> None:
        before = snapshot(self.allocator)
        with pytest.raises(ValueError):
            self.allocator.free(sorted(self.held)[:2] + [foreign])
        assert snapshot(self.allocator) == before

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "allocator"):
            return
        a = self.allocator
        assert all(a.ref_count(i) == 1 for i in self.held)
        assert a.num_used_blocks == num_referenced(a) == len(self.held)
        a.check()


AllocatorMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
