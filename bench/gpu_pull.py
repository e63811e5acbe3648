"""Pull bandwidth: the block copy kernel vs torch index_select vs a plain device-to-device copy of
the same bytes; cross-GPU (kernel reading a peer pool vs a plain peer copy) when 2 GPUs.

Blocks: 16 tokens x 32 layers x (K, V) x 8 KV heads x head_dim 128, bf16 = 2 MiB each.
Bandwidth counts bytes read + bytes written. Usage: python bench/gpu_pull.py --out pull.json
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from common.kv.blockcopy import copy_blocks

BLOCK = (16, 32, 2, 8, 128)


def _time_ms(fn, reps: int, device: int, batch: int = 1) -> float:
    """Median over `reps` of the event-timed time of `batch` back-to-back calls, per call.

    batch=1 counts the host work of each call (the GPU idles meanwhile); batch>1 lets it overlap
    the previous call's GPU work, which is how a busy decode loop sees it.
    """
    with torch.cuda.device(device):
        for _ in range(3):
            fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(batch):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / batch)
    times.sort()
    return times[len(times) // 2]


def _case(src_dev: int, dst_dev: int, pool_blocks: int, n: int, reps: int) -> dict[str, float]:
    src = torch.randn((pool_blocks, *BLOCK), device=f"cuda:{src_dev}").to(torch.bfloat16)
    dst = torch.empty((pool_blocks, *BLOCK), device=f"cuda:{dst_dev}", dtype=torch.bfloat16)
    rng = random.Random(0)
    src_ids, dst_ids = rng.sample(range(pool_blocks), n), rng.sample(range(pool_blocks), n)
    s_idx = torch.tensor(src_ids, device=f"cuda:{src_dev}")
    out = torch.empty((n, *BLOCK), device=f"cuda:{dst_dev}", dtype=torch.bfloat16)
    nbytes = n * src[0].numel() * 2
    pull = lambda: copy_blocks(dst, src, dst_ids, src_ids)  # noqa: E731
    results = {
        "kernel": _time_ms(pull, reps, dst_dev, batch=8),
        "kernel_single": _time_ms(pull, reps, dst_dev),
        "plain_copy": _time_ms(lambda: dst[:n].copy_(src[:n]), reps, dst_dev, batch=8),
    }
    if src_dev == dst_dev:
        results["index_select"] = _time_ms(
            lambda: torch.index_select(src, 0, s_idx, out=out), reps, dst_dev, batch=8
        )
    expected = src[torch.tensor(src_ids, device=f"cuda:{src_dev}")].to(f"cuda:{dst_dev}")
    copy_blocks(dst, src, dst_ids, src_ids)
    torch.cuda.synchronize(dst_dev)
    assert torch.equal(dst[torch.tensor(dst_ids, device=f"cuda:{dst_dev}")], expected)
    return {f"{k}_GBps": 2 * nbytes / (ms * 1e-3) / 1e9 for k, ms in results.items()} | {
        "bytes": nbytes,
        "blocks": n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--pool-blocks", type=int, default=2048)  # 4 GiB per pool
    parser.add_argument("--blocks", type=int, default=1024)  # 2 GiB pulled
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    report = {
        "device": torch.cuda.get_device_name(0),
        "block_bytes": 2 * torch.Size(BLOCK).numel(),
        "same_gpu": _case(0, 0, args.pool_blocks, args.blocks, args.reps),
    }
    same = report["same_gpu"]
    same["kernel_vs_copy"] = same["kernel_GBps"] / same["plain_copy_GBps"]
    if torch.cuda.device_count() >= 2:
        cross = _case(0, 1, args.pool_blocks // 2, args.blocks // 2, args.reps)
        cross["kernel_vs_copy"] = cross["kernel_GBps"] / cross["plain_copy_GBps"]
        report["cross_gpu"] = cross
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(
        f"{'case':<10} {'kernel GB/s':>12} {'single call':>12} {'index_select':>13} "
        f"{'plain copy':>11} {'ratio':>6}"
    )
    for name in ("same_gpu", "cross_gpu"):
        if name in report:
            r = report[name]
            sel = r.get("index_select_GBps", float("nan"))
            print(
                f"{name:<10} {r['kernel_GBps']:>12.0f} {r['kernel_single_GBps']:>12.0f} {sel:>13.0f} "
                f"{r['plain_copy_GBps']:>11.0f} {r['kernel_vs_copy']:>6.2f}"
            )


if __name__ == "__main__":
    main()
