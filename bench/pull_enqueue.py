"""Host cost of enqueueing one pull on CUDA, as the decode's KVConsumer does for each HANDOFF, in
one process (no IPC, no daemons), at TinyLlama-1.1B's KV layout: the wait on an interprocess
event, `KVPool.copy_blocks_from` on a side stream (of it, the kernel launch alone), the event
after it; then the time until the copy is complete. p50 over `--pulls` pulls of random blocks,
for 4, 125 and 1,024 blocks.

`--gap-ms G` sleeps G ms between pulls, as a decode at low load idles between handoffs: the
first pull after an idle spell runs on a cold core (its caches and clock), which a loop of
back-to-back pulls never shows.

    python bench/pull_enqueue.py [--device cuda:0] [--gap-ms 0] [--pulls 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.cuda import ext, stream_ptr
from common.kv.blockcopy import copy_ids_cuda
from common.kv.pool import KVPool, PoolLayout

LAYOUT = PoolLayout(
    num_blocks=4096, num_layers=22, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16"
)
PARTS = ("wait", "copy", "launch", "event", "complete")


def one_pull(
    src: KVPool, dst: KVPool, stream: torch.cuda.Stream, ipc_event: int, n: int
) -> dict[str, float]:
    """µs of each part of one pull of n random blocks: the interprocess event wait, the whole
    copy_blocks_from, the launch alone (a second copy, ids ready as arrays), the event record
    after it, and from there until the copies are complete."""
    src_ids = random.sample(range(LAYOUT.num_blocks), n)
    dst_ids = random.sample(range(LAYOUT.num_blocks), n)
    s_arr, d_arr = np.asarray(src_ids, np.int64), np.asarray(dst_ids, np.int64)
    t0 = time.perf_counter_ns()
    ext().stream_wait_event(stream_ptr(stream, dst.device.index), ipc_event)
    t1 = time.perf_counter_ns()
    dst.copy_blocks_from(src, src_ids, dst_ids, stream)
    t2 = time.perf_counter_ns()
    copy_ids_cuda(dst.tensor, src.tensor, s_arr, d_arr, stream)
    t3 = time.perf_counter_ns()
    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    t4 = time.perf_counter_ns()
    done.synchronize()
    t5 = time.perf_counter_ns()
    return dict(
        zip(
            PARTS,
            (
                (b - a) / 1e3
                for a, b in zip((t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5), strict=True)
            ),
            strict=True,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="idle between pulls (cold path)")
    ap.add_argument("--pulls", type=int, default=300)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    src, dst = KVPool.create(LAYOUT, args.device), KVPool.create(LAYOUT, args.device)
    dev = src.device.index
    stream = torch.cuda.Stream(args.device)
    ipc_event = ext().event_create(dev)  # the kind the prefill's ring records (completed here)
    ext().event_record(ipc_event, stream_ptr(None, dev))
    for n in (4, 125, 1024):
        for _ in range(20):
            one_pull(src, dst, stream, ipc_event, n)
        runs = []
        for _ in range(args.pulls):
            if args.gap_ms:
                time.sleep(args.gap_ms / 1000)
            runs.append(one_pull(src, dst, stream, ipc_event, n))
        p50 = {k: statistics.median(r[k] for r in runs) for k in PARTS}
        print(
            f"{n} blocks, gap {args.gap_ms:g} ms: enqueue p50 "
            f"{p50['wait'] + p50['copy'] + p50['event']:.1f} µs (event wait {p50['wait']:.1f}, "
            f"copy_blocks_from {p50['copy']:.1f} of which a bare launch {p50['launch']:.1f}, "
            f"event {p50['event']:.1f}), then complete p50 {p50['complete']:.1f} µs (two copies)"
        )
    ext().event_destroy(ipc_event)


if __name__ == "__main__":
    main()
