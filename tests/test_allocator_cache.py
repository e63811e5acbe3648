"""The prefix cache in the block allocator: named blocks shared by requests (refcounted), kept
CACHED after their last holder and evicted least recently freed first only when FREE runs out;
leased blocks never handed out; names from common.kv.blockhash."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from common.errors import AllocatorError, OutOfBlocks
from common.kv.allocator import BlockAllocator, BlockState
from common.kv.blockhash import block_names, hash_seed

SEED = hash_seed(model="m", dtype="float32", block_size=4, layout={"num_layers": 2})


def _names(tokens: list[int]) -> list[bytes]:
    return block_names(tokens, 4, SEED)


def _computed(alloc: BlockAllocator, rid: str, tokens: list[int]) -> list[int]:
    """A request that looked up its prefix, took the rest fresh, and published its full blocks."""
    names = _names(tokens)
    hit = alloc.lookup(names)
    blocks = alloc.allocate(rid, -(-len(tokens) // 4) - len(hit), reuse=hit)
    alloc.publish(rid, names)
    return blocks


def test_names_chain_over_tokens_position_and_seed() -> None:
    a = _names(list(range(12)))
    assert len(a) == 3 and len(set(a)) == 3
    assert _names(list(range(10))) == a[:2]  # a partial block is never named
    assert _names([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11])[2] != a[2]  # the parent changes it
    for other in (
        hash_seed(model="m2", dtype="float32", block_size=4, layout={"num_layers": 2}),
        hash_seed(model="m", dtype="bfloat16", block_size=4, layout={"num_layers": 2}),
        hash_seed(model="m", dtype="float32", block_size=8, layout={"num_layers": 2}),
        hash_seed(model="m", dtype="float32", block_size=4, layout={"num_layers": 3}),
    ):
        assert block_names(list(range(12)), 4, other)[0] != a[0]
    assert (
        hash_seed(
            model="m", dtype="float32", block_size=4, layout={"num_layers": 2, "num_blocks": 9}
        )
        == SEED
    )


def test_a_freed_named_block_stays_cached_and_is_reused() -> None:
    alloc = BlockAllocator(8)
    first = _computed(alloc, "a", list(range(10)))  # 2 full blocks + a partial one
    alloc.free("a")
    assert [alloc.state_of(b) for b in first] == [BlockState.CACHED] * 2 + [BlockState.FREE]
    assert (alloc.num_free, alloc.num_cached, alloc.num_named) == (8, 2, 2)
    second = _computed(alloc, "b", [*range(8), 50, 51, 52])
    assert second[:2] == first[:2] and second[2] != first[1]
    assert alloc.num_cached == 0 and alloc.num_owned == 3


def test_shared_blocks_are_refcounted_and_never_freed_under_a_reader() -> None:
    alloc = BlockAllocator(6)
    a = _computed(alloc, "a", list(range(8)))
    alloc.lease("a", "link-1", 10.0)
    b = _computed(alloc, "b", list(range(9)))
    assert b[:2] == a and alloc.holders_of(a[0]) == ["a", "b"]
    assert alloc.state_of(a[0]) is BlockState.LEASED  # leased through "a", owned by "b"
    assert alloc.lease_holders(a[0]) == {"link-1"}
    assert (alloc.num_free, alloc.num_owned, alloc.num_leased) == (3, 1, 2)
    alloc.free("b")  # "b" aborted: "a"'s reader keeps them
    assert alloc.state_of(a[0]) is BlockState.LEASED and alloc.num_cached == 0
    with pytest.raises(OutOfBlocks):
        alloc.allocate("c", 5)  # the leased pair is not free
    alloc.release("a")
    assert alloc.state_of(a[0]) is BlockState.CACHED and alloc.num_free == 6


def test_eviction_takes_free_blocks_first_then_least_recently_freed() -> None:
    alloc = BlockAllocator(6)
    old = _computed(alloc, "old", list(range(8)))
    alloc.free("old")
    new = _computed(alloc, "new", list(range(100, 108)))
    alloc.free("new")
    assert alloc.num_cached == 4 and alloc.evictions == 0
    free = set(range(6)) - {*old, *new}
    got = alloc.allocate("x", 3)  # 2 FREE, then the deepest block of the oldest chain
    assert set(got) == {*free, old[1]} and alloc.evictions == 1
    assert got == sorted(got)  # in ascending ids: a FREE block next to the evicted one joins it
    assert alloc.lookup(_names(list(range(8)))) == [old[0]]  # its parent is still cached
    assert alloc.lookup(_names(list(range(100, 108)))) == new


def test_capacity_counts_reused_blocks_once() -> None:
    alloc = BlockAllocator(4)
    blocks = _computed(alloc, "a", list(range(8)))
    alloc.free("a")
    hit = alloc.lookup(_names(list(range(8))))
    assert alloc.can_allocate(2, reuse=hit) and not alloc.can_allocate(3, reuse=hit)
    assert alloc.allocate("b", 2, reuse=hit)[:2] == blocks
    with pytest.raises(AllocatorError, match="already held"):
        alloc.allocate("b", 0, reuse=hit[:1])


def test_concurrent_identical_prompts_keep_one_copy() -> None:
    alloc = BlockAllocator(8)
    names = _names(list(range(8)))
    a = alloc.allocate("a", 2)
    b = alloc.allocate("b", 2)  # both missed: neither was published yet
    assert alloc.publish("a", names) == 2
    assert alloc.publish("b", names) == 0  # a's copy is the cached one
    alloc.free("b")
    assert [alloc.state_of(x) for x in b] == [BlockState.FREE] * 2
    alloc.free("a")
    assert alloc.lookup(names) == a


def test_misuse_is_refused() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate("a", 1)
    with pytest.raises(AllocatorError, match="not named"):
        alloc.allocate("b", 0, reuse=[0])
    with pytest.raises(AllocatorError, match="cannot name"):
        alloc.publish("a", _names(list(range(8))))
    alloc.publish("a", _names(list(range(4))))
    with pytest.raises(AllocatorError, match="named otherwise"):
        alloc.publish("a", _names(list(range(1, 5))))


class CacheMachine(RuleBasedStateMachine):
    """Requests over a few prompts sharing prefixes, leased, freed and evicted at random; after
    every step: the pool is partitioned, every named block maps back, no held or leased block
    is CACHED or FREE, and a lookup returns only blocks that hold exactly the names asked."""

    TOTAL = 10
    PROMPTS = ([1] * 12, [1] * 8 + [2] * 4, [3] * 9, [1] * 4 + [5] * 5)

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(self.TOTAL)
        self.live: dict[str, bool] = {}  # rid -> leased
        self.n = 0

    @rule(p=st.integers(0, 3))
    def start(self, p: int) -> None:
        tokens = self.PROMPTS[p]
        names = _names(tokens)
        hit = self.alloc.lookup(names)
        need = -(-len(tokens) // 4) - len(hit)
        rid = f"r{self.n}"
        self.n += 1
        if not self.alloc.can_allocate(need, reuse=hit):
            with pytest.raises(OutOfBlocks):
                self.alloc.allocate(rid, need, reuse=hit)
            return
        self.alloc.allocate(rid, need, reuse=hit)
        self.alloc.publish(rid, names)
        self.live[rid] = False
        assert [self.alloc.name_of(b) for b in self.alloc.blocks_of(rid)[: len(names)]] == names

    @rule(data=st.data())
    def lease(self, data: st.DataObject) -> None:
        owned = sorted(r for r, leased in self.live.items() if not leased)
        if owned:
            rid = data.draw(st.sampled_from(owned))
            self.alloc.lease(rid, "link", None)
            self.live[rid] = True

    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        if self.live:
            rid = data.draw(st.sampled_from(sorted(self.live)))
            self.alloc.free(rid)
            del self.live[rid]

    @invariant()
    def consistent(self) -> None:
        a = self.alloc
        assert a.num_free + a.num_owned + a.num_leased == a.total
        held: dict[int, set[str]] = {}
        for rid in a.requests():
            for b in a.blocks_of(rid):
                held.setdefault(b, set()).add(rid)
        for b in range(a.total):
            state = a.state_of(b)
            leased = any(self.live[r] for r in held.get(b, ()))
            want = BlockState.LEASED if leased else BlockState.OWNED
            if b in held:
                assert state is want and set(a.holders_of(b)) == held[b]
            else:
                assert state is (BlockState.CACHED if a.name_of(b) else BlockState.FREE)
            if (name := a.name_of(b)) is not None:
                assert a.block_named(name) == b
        assert a.num_cached == sum(a.state_of(b) is BlockState.CACHED for b in range(a.total))
        for tokens in self.PROMPTS:
            names = _names(tokens)
            assert [a.name_of(b) for b in a.lookup(names)] == names[: len(a.lookup(names))]


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, database=None
)


class _Id(int):
    """An int subclass: a block id state_of accepts."""


def _reuse_error(alloc: BlockAllocator, rid: str, reuse: list[Any]) -> str | None:
    """What allocate(rid, _, reuse=reuse) must refuse, by the checks' plain definition: each a
    block id, named, not the request's own, none twice."""
    for block in reuse:
        try:
            alloc.state_of(block)
        except AllocatorError as exc:
            return str(exc)
        if alloc.name_of(block) is None:
            return f"block {block} is not named: only cached KV can be reused"
        if rid in alloc.holders_of(block):
            return f"block {block} is already held by {rid!r}"
    return f"reused blocks repeat: {reuse}" if len(set(reuse)) != len(reuse) else None


@settings(max_examples=300, deadline=None)
@given(
    rid=st.sampled_from(["h", "new"]),
    n=st.integers(0, 6),
    reuse=st.lists(
        st.integers(-2, 9) | st.builds(_Id, st.integers(0, 7)) | st.sampled_from([True, 1.5]),
        max_size=5,
    ),
)
def test_reuse_is_checked_and_counted_as_defined(rid: str, n: int, reuse: list[Any]) -> None:
    """The one-pass check in allocate refuses exactly what the definition refuses (changing
    nothing), and otherwise succeeds exactly when can_allocate says so."""
    alloc = BlockAllocator(8)
    _computed(alloc, "a", list(range(8)))  # two named blocks ...
    alloc.free("a")  # ... CACHED
    _computed(alloc, "h", [*range(50, 58), 9])  # two named blocks h holds, one unnamed
    before = [alloc.state_of(b) for b in range(8)], alloc.num_free
    want = _reuse_error(alloc, rid, reuse)
    fits = alloc.can_allocate(n, reuse=reuse)
    if want is not None:
        with pytest.raises(AllocatorError) as err:
            alloc.allocate(rid, n, reuse=reuse)
        assert str(err.value) == want and not isinstance(err.value, OutOfBlocks)
    elif not fits:
        with pytest.raises(OutOfBlocks):
            alloc.allocate(rid, n, reuse=reuse)
    else:
        blocks = alloc.allocate(rid, n, reuse=reuse)
        assert blocks[: len(reuse)] == reuse and len(blocks) == len(reuse) + n
        assert all(alloc.state_of(b) is BlockState.OWNED for b in blocks)
        assert alloc.num_free == before[1] - n - sum(
            before[0][b] is BlockState.CACHED for b in reuse
        )
        return
    assert ([alloc.state_of(b) for b in range(8)], alloc.num_free) == before
