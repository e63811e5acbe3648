"""A prompt's block names computed only as far as they are read (common.kv.blockhash.LazyNames):
the same names as block_names, whichever way they are read, and a lookup that misses at the first
block computes one name, not one per block."""

from __future__ import annotations

import random

import pytest

from common.kv.allocator import BlockAllocator
from common.kv.blockhash import LazyNames, block_names, hash_seed
from common.kv.pool import PoolLayout
from common.kv.prefix_cache import PrefixCache

SEED = hash_seed(model="m", dtype="float32", block_size=16, layout={"num_layers": 2})


@pytest.mark.parametrize("n", [0, 5, 16, 17, 100, 1664, 2049])
def test_every_way_of_reading_gives_block_names(n: int) -> None:
    rng = random.Random(n)
    tokens = [rng.randrange(32000) for _ in range(n)]
    ref = block_names(tokens, 16, SEED)
    assert list(LazyNames(tokens, 16, SEED)) == ref
    assert len(LazyNames(tokens, 16, SEED)) == len(ref)
    lazy = LazyNames(tokens, 16, SEED)
    if ref:
        assert lazy[-1] == ref[-1] and lazy[0] == ref[0]
        assert lazy[1:3] == ref[1:3] and lazy[:] == ref
    part = LazyNames(tokens, 16, SEED)
    first = [name for _, name in zip(range(3), part, strict=False)]
    assert first == ref[:3]
    part.fill()
    assert part.computed == len(ref) and list(part) == ref


def _cache(blocks: int = 256) -> PrefixCache:
    layout = PoolLayout(
        num_blocks=blocks, num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32"
    )
    return PrefixCache(BlockAllocator(blocks), layout, "m", True)


def test_a_miss_at_the_first_block_computes_one_name_and_a_hit_its_run() -> None:
    cache = _cache()
    shared = list(range(1000, 1000 + 16 * 40))
    first = cache.names([*shared, 1, 2, 3])
    blocks = cache.allocator.allocate("a", -(-len([*shared, 1, 2, 3]) // 16))
    cache.complete(first)
    cache.allocator.publish("a", first)
    assert blocks and first.computed == 40
    other = cache.names([*list(range(5000, 5000 + 16 * 40)), 9])
    assert cache.hit(other, 16 * 40 + 1) == [] and other.computed == 1  # nothing shared: one hash
    again = cache.names([*shared, 7, 8])
    hit = cache.hit(again, len(shared) + 2)
    assert hit == blocks[:40]  # every shared block, in order
    assert again.computed == 40  # its run, which is every full block here
    assert list(again) == block_names([*shared, 7, 8], 16, cache.seed)
