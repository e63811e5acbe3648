"""Runs of adjacent blocks per handoff under churn: what a pull copies as one memcpy and a NIXL
transfer posts as one descriptor (`kvpool.block_runs` of the prefill's and the decode's blocks).

Two real BlockAllocators, a prefill's and a decode's, serve a Poisson stream of requests without
a model: the prefill allocates a prompt's blocks and frees them at the handoff (named first when
the prefix cache is on, so they stay CACHED and later allocations evict them), the decode holds
prompt + output blocks until its request's output time has passed. Counts, not timings: the same
on any machine.

    .venv/bin/python bench/block_runs.py [--blocks 4096] [--requests 3000] [--cache]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.kv.allocator import BlockAllocator
from common.kv.pool import block_runs


def runs_per_handoff(args: argparse.Namespace) -> list[int]:
    rng = random.Random(args.seed)
    prefill, decode = BlockAllocator(args.blocks), BlockAllocator(args.blocks)
    live: list[tuple[float, str]] = []  # (end time, request id) on the decode
    runs: list[int] = []
    now = 0.0
    for i in range(args.requests):
        now += rng.expovariate(args.rate)
        for end, rid in [x for x in live if x[0] <= now]:
            if args.cache:  # the decode names its prompt's full blocks too
                decode.publish(rid, [os.urandom(16) for _ in decode.blocks_of(rid)[:4]])
            decode.free(rid)
            live.remove((end, rid))
        prompt, output = rng.randint(*args.prompt_len), rng.randint(*args.output_len)
        p_blocks, d_blocks = -(-prompt // 16), -(-(prompt + output) // 16)
        if decode.num_free < d_blocks or prefill.num_free < p_blocks:
            continue  # NO_CAPACITY: the request is not counted
        rid = f"r{i}"
        src, dst = prefill.allocate(rid, p_blocks), decode.allocate(rid, d_blocks)
        runs.append(len(block_runs(src, dst[:p_blocks])))
        if args.cache:
            prefill.publish(rid, [os.urandom(16) for _ in range(prompt // 16)])
        prefill.free(rid)
        live.append((now + output * args.token_s, rid))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=4096, help="blocks in each pool")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=20.0, help="requests/s")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    ap.add_argument("--token-s", type=float, default=0.003, help="decode time per output token")
    ap.add_argument("--cache", action="store_true", help="the prefix cache on (blocks named)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    runs = sorted(runs_per_handoff(args))
    print(
        f"{len(runs)} handoffs, runs per handoff: mean {statistics.mean(runs):.2f}, "
        f"p50 {runs[len(runs) // 2]}, p99 {runs[int(len(runs) * 0.99)]}"
        f" (cache {'on' if args.cache else 'off'})"
    )


if __name__ == "__main__":
    main()
