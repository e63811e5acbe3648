"""The host KV tier on CUDA (common/kv/tier_io.py): blocks written from a GPU pool through the
pinned tier on the side stream come back bit-exact into other blocks (bf16, an 8B model's block
shape), a corrupted slot stops the restore there, and a block the compute stream rewrites right
after the write-back is stored as it was (the compute stream waits for the copy)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.kv.host_tier import HostTier
from common.kv.pool import KVPool, PoolLayout
from common.kv.tier_io import PoolTier

pytestmark = pytest.mark.gpu


@pytest.fixture
def pool_tier() -> Iterator[PoolTier]:
    layout = PoolLayout(
        num_blocks=64, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16"
    )
    pool = KVPool.create(layout, device="cuda:0")
    pool.tensor.copy_(torch.randn(pool.tensor.shape, device="cuda:0").to(torch.bfloat16))
    path = Path(f"/dev/shm/pdkv-test-gpu-tier-{os.getpid()}")
    tier = HostTier.open(
        path, slot_bytes=layout.block_nbytes, capacity_bytes=40 * layout.block_nbytes
    )
    pt = PoolTier(tier, pool, b"seed")
    yield pt
    pt.close()
    path.unlink(missing_ok=True)


def names(n: int) -> list[bytes]:
    return [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(n)]


def restore(pt: PoolTier, names: list[bytes], blocks: list[int]) -> int:
    return asyncio.run(pt.restore_async(names, blocks))


def _settle(pt: PoolTier) -> None:
    pt._commits.submit(lambda: None).result()  # the commits queued on their thread


def test_write_back_and_restore_are_exact(pool_tier: PoolTier) -> None:
    pt, n = pool_tier, names(8)
    assert pt.write(list(zip(n, range(8), strict=True))) == 8
    _settle(pt)
    assert restore(pt, n, list(range(32, 40))) == 8
    torch.cuda.synchronize()
    assert torch.equal(pt.pool.tensor[32:40], pt.pool.tensor[0:8])
    assert pt.tier.counts["checksum_failures"] == 0


def test_a_corrupted_slot_stops_the_restore(pool_tier: PoolTier) -> None:
    pt, n = pool_tier, names(4)
    pt.write(list(zip(n, range(4), strict=True)))
    _settle(pt)
    hits = pt.tier.lookup(n)
    pt.tier.slots[hits[2].slot][7] ^= 0xFF
    assert restore(pt, n, list(range(40, 44))) == 2
    assert pt.tier.counts["checksum_failures"] == 1


def test_compute_stream_waits_for_the_write_back(pool_tier: PoolTier) -> None:
    pt, n = pool_tier, names(1)
    want = pt.pool.tensor[5].clone()
    pt.write([(n[0], 5)])
    pt.pool.tensor[5].fill_(0)  # queued after the copy on the compute stream
    _settle(pt)
    assert restore(pt, n, [50]) == 1
    torch.cuda.synchronize()
    assert torch.equal(pt.pool.tensor[50], want)
