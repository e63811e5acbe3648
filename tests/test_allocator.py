"""BlockAllocator: every error path, the lease verbs, and a stateful model check."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from common.errors import AllocatorError, OutOfBlocks
from common.kv.allocator import BlockAllocator, BlockState, Lease


def test_allocate_hands_out_ascending_ids_and_appends() -> None:
    alloc = BlockAllocator(8)
    assert alloc.allocate("a", 3) == [0, 1, 2]
    assert alloc.allocate("b", 2) == [3, 4]
    assert alloc.allocate("a", 1) == [5]
    assert alloc.blocks_of("a") == [0, 1, 2, 5]
    assert (alloc.num_free, alloc.num_owned, alloc.num_leased) == (2, 6, 0)
    assert alloc.state_of(5) is BlockState.OWNED
    assert alloc.owner_of(4) == "b"
    assert alloc.state_of(7) is BlockState.FREE
    assert alloc.owner_of(7) is None
    assert sorted(alloc.requests()) == ["a", "b"]


def test_freed_blocks_come_back_in_the_same_order() -> None:
    alloc = BlockAllocator(8)
    alloc.allocate("a", 4)
    assert alloc.free("a") == 4
    assert alloc.allocate("b", 4) == [0, 1, 2, 3]


def test_allocate_zero_registers_request() -> None:
    alloc = BlockAllocator(2)
    assert alloc.allocate("a", 0) == []
    assert "a" in alloc
    assert alloc.free("a") == 0
    assert "a" not in alloc


def test_out_of_blocks_names_counts_and_changes_nothing() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate("a", 3)
    assert alloc.can_allocate(1)
    assert not alloc.can_allocate(2)
    with pytest.raises(OutOfBlocks, match=r"requested 2, free 1 of 4") as info:
        alloc.allocate("b", 2)
    assert (info.value.requested, info.value.free, info.value.total) == (2, 1, 4)
    assert "b" not in alloc
    assert alloc.num_free == 1


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "3"])
def test_bad_pool_size(bad: object) -> None:
    with pytest.raises(AllocatorError, match="num_blocks must be a positive int"):
        BlockAllocator(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 1.5, None])
def test_bad_block_count(bad: object) -> None:
    alloc = BlockAllocator(4)
    with pytest.raises(AllocatorError, match="block count must be a non-negative int"):
        alloc.allocate("a", bad)  # type: ignore[arg-type]
    with pytest.raises(AllocatorError, match="block count"):
        alloc.can_allocate(bad)  # type: ignore[arg-type]


def test_bad_request_id() -> None:
    alloc = BlockAllocator(4)
    with pytest.raises(AllocatorError, match="request id must be a non-empty str"):
        alloc.allocate("", 1)


def test_double_free_and_unknown_request() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate("a", 2)
    alloc.free("a")
    for verb in (alloc.free, alloc.release, alloc.blocks_of, alloc.lease_of):
        with pytest.raises(AllocatorError, match=r"unknown request 'a'"):
            verb("a")
    with pytest.raises(AllocatorError, match="unknown request 'zz'"):
        alloc.lease("zz", "link-1", None)
    assert alloc.num_free == 4


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_block_id_out_of_range(bad: int) -> None:
    alloc = BlockAllocator(4)
    with pytest.raises(AllocatorError, match=rf"block id {bad} out of range \[0, 4\)"):
        alloc.state_of(bad)
    with pytest.raises(AllocatorError, match="out of range"):
        alloc.owner_of(bad)


def test_lease_release_cycle() -> None:
    alloc = BlockAllocator(6)
    alloc.allocate("a", 2)
    alloc.allocate("b", 3)
    alloc.lease("a", "link-1", 10.0)
    assert alloc.lease_of("a") == Lease("link-1", 10.0)
    assert alloc.lease_of("b") is None
    assert [alloc.state_of(b) for b in range(6)] == [BlockState.LEASED] * 2 + [
        BlockState.OWNED
    ] * 3 + [BlockState.FREE]
    assert (alloc.num_free, alloc.num_owned, alloc.num_leased) == (1, 3, 2)
    assert alloc.release("a") == 2
    assert (alloc.num_free, alloc.num_owned, alloc.num_leased) == (3, 3, 0)


def test_lease_misuse() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate("a", 1)
    with pytest.raises(AllocatorError, match="not leased; use free"):
        alloc.release("a")
    with pytest.raises(AllocatorError, match="holder must be a non-empty str"):
        alloc.lease("a", "", None)
    with pytest.raises(AllocatorError, match="deadline must be a number"):
        alloc.lease("a", "link", float("nan"))
    alloc.lease("a", "link", None)
    with pytest.raises(AllocatorError, match="already leased to 'link'"):
        alloc.lease("a", "link-2", None)
    with pytest.raises(AllocatorError, match="leased request cannot grow"):
        alloc.allocate("a", 1)


def test_free_ends_a_lease() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate("a", 2)
    alloc.lease("a", "link", 1.0)
    assert alloc.free("a") == 2
    assert alloc.num_leased == 0
    assert alloc.expired(5.0) == []
    assert alloc.release_holder("link") == []


def test_release_holder_frees_only_that_peer() -> None:
    alloc = BlockAllocator(8)
    for rid, holder in [("a", "p1"), ("b", "p2"), ("c", "p1")]:
        alloc.allocate(rid, 2)
        alloc.lease(rid, holder, None)
    alloc.allocate("d", 1)
    assert alloc.release_holder("p1") == ["a", "c"]
    assert sorted(alloc.requests()) == ["b", "d"]
    assert (alloc.num_free, alloc.num_owned, alloc.num_leased) == (5, 1, 2)
    assert alloc.release_holder("p1") == []
    assert alloc.release_holder("nobody") == []


def test_expired_reports_due_leases_earliest_first_without_freeing() -> None:
    alloc = BlockAllocator(16)
    for i, deadline in enumerate([5.0, 1.0, None, 3.0, 9.0]):
        alloc.allocate(f"r{i}", 1)
        alloc.lease(f"r{i}", "link", deadline)
    alloc.allocate("owned", 1)
    assert alloc.expired(0.5) == []
    assert alloc.expired(3.0) == ["r1", "r3"]
    assert alloc.expired(3.0) == ["r1", "r3"]  # a query, not a state change
    alloc.release("r1")
    assert alloc.expired(6.0) == ["r3", "r0"]
    alloc.free("r0")
    alloc.release("r3")
    # Re-leasing a freed id must not resurrect its old heap entry.
    alloc.allocate("r0", 1)
    alloc.lease("r0", "link", 100.0)
    assert alloc.expired(50.0) == ["r4"]
    assert alloc.expired(1000.0) == ["r4", "r0"]


def test_expired_heap_stays_bounded_under_churn() -> None:
    alloc = BlockAllocator(4)
    for i in range(1000):
        alloc.allocate("r", 1)
        alloc.lease("r", "link", float(i))
        alloc.release("r")
    assert len(alloc._leases) <= 130  # stale entries are compacted, not kept forever
    assert alloc.expired(1e9) == []


def _counts(alloc: BlockAllocator) -> tuple[int, int, int, int]:
    return (alloc.total, alloc.num_free, alloc.num_owned, alloc.num_leased)


def test_reserve_takes_a_free_block_out_of_the_pool_for_good() -> None:
    alloc = BlockAllocator(8)
    mine = alloc.reserve()
    assert 0 <= mine < 8
    assert _counts(alloc) == (7, 7, 0, 0)  # it left the total: nothing counts it
    assert alloc.state_of(mine) is BlockState.RESERVED  # not FREE: no allocation may take it
    blocks = alloc.allocate("a", 7)  # every block a request may hold
    assert mine not in blocks and sorted([*blocks, mine]) == list(range(8))
    assert _counts(alloc) == (7, 0, 7, 0)
    assert not alloc.can_allocate(1)
    with pytest.raises(OutOfBlocks) as info:
        alloc.allocate("b", 1)
    assert (info.value.requested, info.value.free, info.value.total) == (1, 0, 7)
    with pytest.raises(OutOfBlocks) as info:
        alloc.reserve()  # nothing FREE: nothing reserved, nothing changed
    assert (info.value.requested, info.value.free, info.value.total) == (1, 0, 7)
    assert _counts(alloc) == (7, 0, 7, 0)
    alloc.lease("a", "link", None)
    assert _counts(alloc) == (7, 0, 0, 7)
    assert alloc.release("a") == 7
    assert _counts(alloc) == (7, 7, 0, 0)
    for rid in ("b", "c"):  # the freed blocks come back without the reserved one, ever
        again = alloc.allocate(rid, 7)
        assert mine not in again and sorted(again) == sorted(blocks)
        assert alloc.free(rid) == 7
    assert _counts(alloc) == (7, 7, 0, 0)
    assert alloc.state_of(mine) is BlockState.RESERVED
    assert alloc.owner_of(mine) is None and alloc.holders_of(mine) == []


def test_reserve_twice_gives_distinct_blocks_and_leaves_others_allocated_alone() -> None:
    alloc = BlockAllocator(6)
    held = alloc.allocate("a", 2)
    first, second = alloc.reserve(), alloc.reserve()
    assert first != second and not {first, second} & set(held)
    assert _counts(alloc) == (4, 2, 2, 0)
    assert alloc.blocks_of("a") == held
    rest = alloc.allocate("b", 2)
    assert sorted([*held, *rest, first, second]) == list(range(6))
    assert alloc.num_free + alloc.num_owned + alloc.num_leased == alloc.total == 4
    alloc.free("a")
    alloc.free("b")
    assert sorted(alloc.allocate("c", 4)) == sorted([*held, *rest])


def test_reserve_never_takes_a_cached_block() -> None:
    alloc = BlockAllocator(2)
    alloc.allocate("a", 2)
    alloc.publish("a", [b"x", b"y"])
    alloc.free("a")  # both CACHED: free to allocate, but they name KV
    assert (alloc.num_free, alloc.num_cached) == (2, 2)
    with pytest.raises(OutOfBlocks):
        alloc.reserve()
    assert _counts(alloc) == (2, 2, 0, 0) and alloc.lookup([b"x", b"y"]) == [0, 1]


def test_every_block_a_request_holds_after_reserve_is_in_range() -> None:
    """reserve() lowers `total`, but block ids still span the whole pool: the highest one can
    be looked at and reused from the cache."""
    alloc = BlockAllocator(4)
    alloc.reserve()
    blocks = alloc.allocate("a", 3)
    alloc.publish("a", [b"x", b"y", b"z"])
    assert [alloc.state_of(b) for b in blocks] == [BlockState.OWNED] * 3
    alloc.free("a")
    hit = alloc.lookup([b"x", b"y", b"z"])
    assert alloc.allocate("b", 0, reuse=hit) == hit  # a prefix-cache hit on those blocks


class AllocatorMachine(RuleBasedStateMachine):
    """Drives the allocator against a dict model; checks the pool is partitioned after each step."""

    TOTAL = 24
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(self.TOTAL)
        self.model: dict[str, tuple[int, str | None, float | None]] = {}  # blocks, holder, dl
        self.counter = 0

    @rule(target=requests, n=st.integers(0, 10))
    def allocate_new(self, n: int) -> str:
        rid = f"r{self.counter}"
        self.counter += 1
        if n > self.alloc.num_free:
            with pytest.raises(OutOfBlocks):
                self.alloc.allocate(rid, n)
            return rid
        assert len(self.alloc.allocate(rid, n)) == n
        self.model[rid] = (n, None, None)
        return rid

    @rule(rid=requests, n=st.integers(0, 6))
    def allocate_more(self, rid: str, n: int) -> None:
        if rid in self.model and self.model[rid][1] is not None:
            with pytest.raises(AllocatorError, match="leased request cannot grow"):
                self.alloc.allocate(rid, n)
            return
        if n > self.alloc.num_free:
            with pytest.raises(OutOfBlocks):
                self.alloc.allocate(rid, n)
            return
        self.alloc.allocate(rid, n)  # an id whose first allocate failed is registered here
        self.model[rid] = (self.model.get(rid, (0, None, None))[0] + n, None, None)

    @rule(rid=requests, holder=st.sampled_from(["p1", "p2"]), dl=st.none() | st.floats(0, 10))
    def lease(self, rid: str, holder: str, dl: float | None) -> None:
        if rid not in self.model or self.model[rid][1] is not None:
            with pytest.raises(AllocatorError):
                self.alloc.lease(rid, holder, dl)
            return
        self.alloc.lease(rid, holder, dl)
        self.model[rid] = (self.model[rid][0], holder, dl)

    @rule(rid=consumes(requests))
    def free(self, rid: str) -> None:
        if rid not in self.model:
            with pytest.raises(AllocatorError):
                self.alloc.free(rid)
            return
        assert self.alloc.free(rid) == self.model.pop(rid)[0]

    @rule(rid=requests)
    def release(self, rid: str) -> None:
        if rid not in self.model or self.model[rid][1] is None:
            with pytest.raises(AllocatorError):
                self.alloc.release(rid)
            return
        assert self.alloc.release(rid) == self.model.pop(rid)[0]

    @rule(holder=st.sampled_from(["p1", "p2", "p3"]))
    def release_holder(self, holder: str) -> None:
        expected = sorted(r for r, (_, h, _) in self.model.items() if h == holder)
        assert self.alloc.release_holder(holder) == expected
        for rid in expected:
            del self.model[rid]

    @precondition(lambda self: self.model)
    @rule(now=st.floats(0, 12))
    def expire(self, now: float) -> None:
        due = self.alloc.expired(now)
        expected = {r for r, (_, h, dl) in self.model.items() if h and dl is not None and dl <= now}
        assert set(due) == expected and len(due) == len(expected)
        deadlines = [self.model[r][2] for r in due]
        assert deadlines == sorted(deadlines)  # type: ignore[type-var]
        for rid in due:
            self.alloc.release(rid)
            del self.model[rid]

    @invariant()
    def partitioned(self) -> None:
        a = self.alloc
        assert a.num_free + a.num_owned + a.num_leased == a.total
        seen: set[int] = set()
        for rid in a.requests():
            blocks = a.blocks_of(rid)
            assert seen.isdisjoint(blocks), "a block is in two requests"
            seen.update(blocks)
            state = BlockState.LEASED if a.lease_of(rid) else BlockState.OWNED
            assert all(a.state_of(b) is state and a.owner_of(b) == rid for b in blocks)
        assert len(seen) == a.num_owned + a.num_leased
        assert a.num_leased == sum(n for n, h, _ in self.model.values() if h is not None)
        assert set(a.requests()) == set(self.model)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, database=None
)
