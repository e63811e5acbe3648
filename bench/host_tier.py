"""Costs of the host KV tier's pieces on this machine (common/kv/host_tier.py), per block: the lock
round trip, crc32 and memcpy bandwidth, a store (reserve + copy + crc + commit), a lookup and a read
(copy + crc + generation check), for the tiny model's block (8 KiB) and an 8B model's (2 MiB:
32 layers, 8 KV heads of 128, bf16, 16 tokens).

    python bench/host_tier.py [--cuda 512]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.kv.host_tier import HostTier

SIZES = {"tiny (8 KiB)": 8192, "8B bf16 (2 MiB)": 2 << 20}


def _per(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    """µs per call of fn(i), best of 3 runs of n calls."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for i in range(n):
            fn(i)
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def bench(label: str, slot: int, n: int) -> None:
    path = Path(f"/dev/shm/pdkv-bench-tier-{os.getpid()}")
    try:
        tier = HostTier.open(path, slot_bytes=slot, capacity_bytes=slot * 4 * n)
        src = np.random.default_rng(0).integers(0, 256, slot, dtype=np.uint8)
        dst = np.empty_like(src)
        names = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(4 * n)]
        lock = _per(lambda i: tier.contains(names[0]), n)
        crc = _per(lambda i: zlib.crc32(src), n)
        copy = _per(lambda i: np.copyto(dst, src), n)
        off = iter(range(4 * n))
        store = _per(lambda i: tier.store(names[next(off)], src), n)
        # into slots written before (the tier full, LRU evicted): no first-touch page faults
        again = HostTier.open(Path(f"{path}-small"), slot_bytes=slot, capacity_bytes=slot * n)
        for i in range(n):
            again.store(names[i], src)
        more = iter(range(n, 4 * n))
        reused = _per(lambda i: again.store(names[next(more)], src), n)
        again.close()
        Path(f"{path}-small").unlink()
        hits = tier.lookup(names[: 3 * n])
        lookup = _per(lambda i: tier.lookup(names[i : i + 1]), n)
        read = _per(lambda i: tier.read(hits[i], dst), n)
        gbs = slot / 1e3  # bytes per µs = MB/s; /1e3 → GB/s
        print(
            f"{label:>16}: lock {lock:6.1f} µs | crc32 {gbs / crc:5.1f} GB/s | memcpy "
            f"{gbs / copy:5.1f} GB/s | store {store:7.1f} µs (fresh) {reused:7.1f} µs (reused) | lookup {lookup:5.1f} µs | "
            f"read {read:8.1f} µs ({gbs / read:4.1f} GB/s)"
        )
        tier.close()
    finally:
        path.unlink(missing_ok=True)


def cuda_restore(blocks: int) -> None:
    """GPU: an 8B bf16 pool's blocks written back to the pinned tier and restored, GB/s each way
    (the side stream's copies plus the crc and the index; issue 43's target: restore >= 40 GB/s)."""
    import asyncio

    import torch

    from common.kv.pool import KVPool, PoolLayout
    from common.kv.tier_io import PoolTier

    layout = PoolLayout(
        num_blocks=2 * blocks, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
        dtype="bfloat16",
    )  # fmt: skip
    pool = KVPool.create(layout, device="cuda:0")
    path = Path(f"/dev/shm/pdkv-bench-tier-cuda-{os.getpid()}")
    try:
        tier = HostTier.open(
            path, slot_bytes=layout.block_nbytes, capacity_bytes=blocks * layout.block_nbytes
        )
        pt = PoolTier(tier, pool, b"seed")
        names = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(blocks)]
        nbytes = blocks * layout.block_nbytes
        torch.cuda.synchronize()
        t = time.perf_counter()
        pt.write(list(zip(names, range(blocks), strict=True)))
        pt.side.synchronize()
        pt._commits.submit(lambda: None).result()  # the commits
        w = time.perf_counter() - t
        for _ in range(3):
            t = time.perf_counter()
            got = asyncio.run(pt.restore_async(names, list(range(blocks, 2 * blocks))))
            r = time.perf_counter() - t
        assert got == blocks
        print(
            f"cuda: {blocks} blocks of {layout.block_nbytes >> 10} KiB: write-back "
            f"{nbytes / w / 1e9:.1f} GB/s, restore {nbytes / r / 1e9:.1f} GB/s (crc included)"
        )
        pt.close()
    finally:
        path.unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument(
        "--cuda", type=int, metavar="BLOCKS", help="also the GPU restore, BLOCKS blocks"
    )
    args = ap.parse_args()
    for label, slot in SIZES.items():
        bench(label, slot, args.n if slot < 1 << 20 else max(8, args.n // 20))
    if args.cuda:
        cuda_restore(args.cuda)


if __name__ == "__main__":
    main()
