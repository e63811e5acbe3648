"""The allocator's FREE blocks as runs (common.kv.free_runs), against a plain set as the reference."""

from __future__ import annotations

import random

import pytest

from common.kv.allocator import BlockAllocator
from common.kv.free_runs import FreeRuns
from common.kv.pool import block_runs


def _runs(blocks: list[int]) -> int:
    return len(block_runs(blocks, blocks))


def test_random_takes_and_puts_hand_out_each_free_block_once_longest_run_first():
    rng = random.Random(5)
    free, ref = FreeRuns(512), set(range(512))
    held: list[list[int]] = []
    for _ in range(3000):
        if held and (rng.random() < 0.5 or len(ref) < 40):
            blocks = held.pop(rng.randrange(len(held)))
            free.put(sorted(blocks))
            ref |= set(blocks)
        else:
            n = rng.randint(1, 40)
            longest = _longest(ref)
            got = free.take(n)
            assert len(got) == n and len(set(got)) == n and set(got) <= ref
            if longest >= n:  # a run long enough was free: the blocks are one run of it
                assert got == list(range(got[0], got[0] + n))
            else:  # the longest run first, whole
                assert got[:longest] == list(range(got[0], got[0] + longest))
            ref -= set(got)
            held.append(got)
        assert len(free) == len(ref)
    for blocks in held:
        free.put(sorted(blocks))
    assert free.take(512) == list(range(512))  # every run merged back into one


def _longest(blocks: set[int]) -> int:
    best = run = 0
    for b in sorted(blocks):
        run = run + 1 if b - 1 in blocks else 1
        best = max(best, run)
    return best


def test_taking_more_than_is_free_changes_nothing():
    free = FreeRuns(8)
    free.take(6)
    with pytest.raises(ValueError, match="3 blocks asked, 2 free"):
        free.take(3)
    assert free.take(2) == [6, 7]


def test_a_churned_pool_still_gives_a_request_one_run_where_one_is_free():
    """Requests freed out of order (the decode's finish in any order): a plain stack of free ids
    handed the next request the last-freed blocks, scattered; the runs are found again."""
    alloc = BlockAllocator(64)
    for i in range(8):
        alloc.allocate(f"r{i}", 8)
    for i in (5, 2, 6, 1):  # free r1, r2 (adjacent: 8..23) and r5, r6 (40..55), out of order
        alloc.free(f"r{i}")
    got = alloc.allocate("big", 16)
    assert _runs(got) == 1, got
    assert _runs(alloc.allocate("next", 16)) == 1


def test_cached_blocks_taken_back_together_come_as_one_run():
    """A full pool of cached blocks: a request evicts the least recently freed, which went back
    to the cache deepest first (descending ids); it gets them as one ascending run."""
    alloc = BlockAllocator(16)
    for i in range(2):
        alloc.allocate(f"r{i}", 8)
        alloc.publish(f"r{i}", [bytes([i, j]) * 8 for j in range(8)])
        alloc.free(f"r{i}")
    assert alloc.num_cached == 16 and alloc.evictions == 0
    got = alloc.allocate("new", 8)
    assert alloc.evictions == 8 and got == list(range(8))  # r0's, least recently freed
