"""Host cost of enqueueing one pull on CUDA: `KVPool.copy_blocks_from` on a side stream plus the
event after it, as the decode's KVConsumer does for each HANDOFF, in one process (no IPC, no
daemons), at TinyLlama-1.1B's KV layout. Prints the host time to enqueue and the time from there
until the copy is complete, p50 over 300 pulls of random blocks, for 4, 125 and 1,024 blocks.

    python bench/pull_enqueue.py [--device cuda:0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.kvpool import KVPool, PoolLayout

LAYOUT = PoolLayout(
    num_blocks=4096, num_layers=22, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16"
)


def one_pull(
    src: KVPool, dst: KVPool, stream: torch.cuda.Stream, n: int
) -> tuple[float, float, float]:
    """(µs to enqueue the copy, µs to create and record the event after it, µs from then until
    the copy is complete) of one pull of n random blocks."""
    src_ids = random.sample(range(LAYOUT.num_blocks), n)
    dst_ids = random.sample(range(LAYOUT.num_blocks), n)
    t0 = time.perf_counter_ns()
    dst.copy_blocks_from(src, src_ids, dst_ids, stream)
    t1 = time.perf_counter_ns()
    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    t2 = time.perf_counter_ns()
    done.synchronize()
    t3 = time.perf_counter_ns()
    return (t1 - t0) / 1e3, (t2 - t1) / 1e3, (t3 - t2) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    src, dst = KVPool.create(LAYOUT, args.device), KVPool.create(LAYOUT, args.device)
    stream = torch.cuda.Stream(args.device)
    for n in (4, 125, 1024):
        for _ in range(20):
            one_pull(src, dst, stream, n)
        runs = [one_pull(src, dst, stream, n) for _ in range(300)]
        copy, event, rest = (statistics.median(r[i] for r in runs) for i in range(3))
        print(
            f"{n} blocks: enqueue p50 {copy + event:.1f} µs (copy {copy:.1f}, event {event:.1f}),"
            f" then complete p50 {rest:.1f} µs"
        )


if __name__ == "__main__":
    main()
