"""The pull's block copy on the GPU, from a pool another process exported (the decode's case) and
from a pool of this process, at TinyLlama-1.1B's KV layout: kernel time by CUDA events, p50
over `--reps` copies of `--blocks` random blocks, and the same copy's host launch time.

A child process creates the source pool and exports it with `--backend` (cuda-raw or
cuda-torch); this process imports it as the decode daemon does, and also makes a local pool of
the same size. Both copies run into one local destination pool on one stream, back to back.

    python bench/ipc_copy.py [--device cuda:0] [--backend cuda-raw] [--blocks 125]
"""

from __future__ import annotations

import argparse
import faulthandler
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.ipc.base import RegionDescriptor
from common.kv.pool import KVPool, PoolLayout
from common.transfer.regions import export_region, open_region

LAYOUT = PoolLayout(
    num_blocks=4096, num_layers=22, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16"
)


def exporter(device: str, backend: str, out: mp.Queue, stop: mp.Event) -> None:
    """The other process: a pool of random bytes, exported; kept alive until `stop`."""
    faulthandler.enable()
    pool = KVPool.create(LAYOUT, device)
    pool.tensor.view(torch.int16).random_()
    torch.cuda.synchronize()
    region = export_region(pool.tensor, backend)
    out.put(msgspec.msgpack.encode(region.desc))
    stop.wait(300)
    region.close()


def timed_copy(dst: KVPool, src: KVPool, n: int, stream: torch.cuda.Stream) -> tuple[float, float]:
    """(µs of GPU time, µs of host launch) of one pull of n random blocks."""
    src_ids = random.sample(range(LAYOUT.num_blocks), n)
    dst_ids = random.sample(range(LAYOUT.num_blocks), n)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    t0 = time.perf_counter_ns()
    dst.copy_blocks_from(src, src_ids, dst_ids, stream)
    t1 = time.perf_counter_ns()
    b.record(stream)
    b.synchronize()
    return a.elapsed_time(b) * 1000, (t1 - t0) / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--backend", default="cuda-raw", choices=["cuda-raw", "cuda-torch"])
    ap.add_argument("--blocks", type=int, default=125)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=exporter, args=(args.device, args.backend, out, stop), daemon=True)
    child.start()
    try:
        desc = msgspec.msgpack.decode(out.get(timeout=120), type=RegionDescriptor)
        device = torch.device(args.device)
        region = open_region(desc, [], device)
        peer = KVPool(LAYOUT, region.to_tensor())
        local, dst = KVPool.create(LAYOUT, device), KVPool.create(LAYOUT, device)
        stream = torch.cuda.Stream(device)
        for name, src in (("imported", peer), ("local", local)):
            for _ in range(5):
                timed_copy(dst, src, args.blocks, stream)
            runs = [timed_copy(dst, src, args.blocks, stream) for _ in range(args.reps)]
            gpu = statistics.median(r[0] for r in runs)
            host = statistics.median(r[1] for r in runs)
            nbytes = args.blocks * LAYOUT.block_nbytes
            print(
                f"{args.backend} {name:8} source, {args.blocks} blocks ({nbytes / 1e6:.1f} MB): "
                f"GPU p50 {gpu:.1f} µs ({2 * nbytes / gpu / 1e3:.0f} GB/s read+write), "
                f"host launch p50 {host:.1f} µs"
            )
        del peer
        region.close()
    finally:
        stop.set()
        child.join(30)


if __name__ == "__main__":
    main()
