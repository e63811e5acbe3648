"""What a sliding window saves in the attention kernels, one layer: the paged-decode kernel and
the paged-context prefill kernel (a prefix-cache hit, chunked prefill) over long contexts, with
no window and with windows shorter than the context (the kernels skip the key tiles, and the
decode's 256-key splits, wholly before a query tile's windows).

At the 8B shape (32 query heads, 8 KV heads, head_dim 128, block size 16, bf16): decode of
--batch rows each at --contexts positions, and the prefill of 512 new tokens after each context
(one sequence). One JSON line per (kernel, context, window): median us by
triton.testing.do_bench, and the relative error against the torch path with the same window
(`paged.paged_attention` / `paged.context_attention`, fp32). A table follows; --out writes them.

    .venv/bin/python bench/sliding_window.py [--contexts 2048 8192] [--windows 0 512 4096] [--out F]
    TRITON_INTERPRET=1 .venv/bin/python bench/sliding_window.py --small   # CPU: checks the script

--small is a tiny fp32 shape for Triton's interpreter: its times say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import triton

from common.model.kernels.attention import paged_decode_attention
from common.model.kernels.context_attention import varlen_context_attention
from common.model.paged import blocks_for, context_attention, paged_attention


def timer(fn, cuda: bool) -> float:  # type: ignore[no-untyped-def]
    """Median us of fn(): do_bench on a GPU, a few wall-clock calls in the interpreter."""
    if cuda:
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    runs = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t) * 1e6)
    return statistics.median(runs)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _pool(rows: int, positions: int, shape: dict, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-layer pool holding `rows` sequences of `positions` positions, shuffled block tables."""
    bs, hkv, d = shape["bs"], shape["hkv"], shape["d"]
    width = blocks_for(positions, bs)
    kv = torch.randn((rows * width + 1, 1, 2, bs, hkv, d), generator=gen)
    tables = (torch.randperm(rows * width, generator=gen) + 1).view(rows, width)
    dev = shape["device"]
    return kv.to(dev, shape["dtype"]), tables.to(dev)


def decode_case(ctx: int, window: int, batch: int, shape: dict, gen, cuda: bool) -> dict:
    kv, tables = _pool(batch, ctx, shape, gen)
    q = torch.randn((batch, shape["hq"], shape["d"]), generator=gen)
    q = q.to(shape["device"], shape["dtype"])
    lens = torch.full((batch,), ctx, device=shape["device"])
    out = paged_decode_attention(q, kv, 0, tables, lens, window=window)
    ref = paged_attention(q.float(), kv.float(), 0, tables, lens, window=window)
    us = timer(lambda: paged_decode_attention(q, kv, 0, tables, lens, window=window), cuda)
    return {"kernel": "decode", "rows": batch, "us": round(us, 2), "rel_ref": rel(out, ref)}


def context_case(ctx: int, window: int, own: int, shape: dict, gen, cuda: bool) -> dict:
    kv, tables = _pool(1, ctx + own, shape, gen)
    q = torch.randn((own, shape["hq"], shape["d"]), generator=gen)
    q = q.to(shape["device"], shape["dtype"])
    dev = shape["device"]
    cu = torch.tensor([0, own], device=dev)
    starts = torch.tensor([ctx], dtype=torch.int32, device=dev)

    def run() -> torch.Tensor:
        return varlen_context_attention(q, kv, 0, cu, starts, tables, own, window=window)

    out = run()
    ref = context_attention(q.float(), kv.float(), 0, tables[0], ctx, window=window)
    return {
        "kernel": "context",
        "rows": own,
        "us": round(timer(run, cuda), 2),
        "rel_ref": rel(out, ref),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny fp32 shape for the interpreter")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 512, 4096])
    ap.add_argument("--batch", type=int, default=16, help="decode rows")
    ap.add_argument("--own", type=int, default=512, help="new tokens of the context prefill")
    ap.add_argument("--out", type=Path, default=None, help="write every result here as JSON")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("bench/sliding_window.py needs CUDA (on CPU: TRITON_INTERPRET=1 ... --small)")
    if args.small:
        shape = dict(hq=8, hkv=2, d=64, bs=16, dtype=torch.float32)
        args.contexts, args.windows, args.batch, args.own = [300], [0, 40], 2, 32
    else:
        shape = dict(hq=32, hkv=8, d=128, bs=16, dtype=torch.bfloat16)
    shape["device"] = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator().manual_seed(0)
    results = []
    for ctx in args.contexts:
        for window in args.windows:
            for case in (
                decode_case(ctx, window, args.batch, shape, gen, cuda),
                context_case(ctx, window, args.own, shape, gen, cuda),
            ):
                row = {"ctx": ctx, "window": window, **case}
                results.append(row)
                print(json.dumps(row), flush=True)
    print(f"{'kernel':>8} {'rows':>5} {'ctx':>6} {'window':>6} {'us':>9} {'rel_ref':>9}")
    for r in results:
        print(
            f"{r['kernel']:>8} {r['rows']:>5} {r['ctx']:>6} {r['window']:>6} {r['us']:>9.1f} "
            f"{r['rel_ref']:>9.1e}"
        )
    if args.out is not None:
        meta = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (interpreter)"}
        meta.update(dtype=str(shape["dtype"]), hq=shape["hq"], hkv=shape["hkv"], d=shape["d"])
        args.out.write_text(json.dumps({"meta": meta, "cases": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
