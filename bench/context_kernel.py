"""The paged-context prefill attention kernel (issue 22) against the one it replaced, one layer.

`varlen_context_attention` (common/model/kernels/context_attention.py) now packs a KV head's GQA
query heads into one tile's rows and splits the keys across programs; the kernel before it (one
program per query tile x query head x sequence, walking the whole context) is kept below, only
for this comparison. At TinyLlama-1.1B's shape (32 query heads, 4 KV heads, head_dim 64, block
size 16, bf16), for each case (own, ctx, seqs) -- `seqs` sequences of `own` new tokens after
`ctx` cached positions each, the block table as wide as the context or --table-blocks (the
width a prefill graph launches with, from which the split count follows) -- one JSON line:
median us of old and new by triton.testing.do_bench (which flushes the L2 before each call; the
calls also rotate over --sets input sets, each its own pool), the number of splits the new
kernel chose, and the relative error of new against old and of new against the torch reference
(`paged.context_attention`, fp32). A table follows; --out writes them all and the settings.

    .venv/bin/python bench/context_kernel.py [--out FILE] [--warps 8 --stages 3] [--table-blocks 128]
    TRITON_INTERPRET=1 .venv/bin/python bench/context_kernel.py --small   # CPU: checks the script

--small is a tiny shape in fp32 for Triton's interpreter: its times say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import triton
import triton.language as tl

from common.model.kernels.attention import online_softmax_step
from common.model.kernels.context_attention import _context_attention, context_splits, context_tiles
from common.model.paged import blocks_for, context_attention

CASES = [(128, 1536, 1), (128, 0, 1), (512, 1024, 1), (1024, 0, 1), (128, 1536, 4), (16, 2048, 8)]
SMALL_CASES = [(16, 48, 1), (16, 0, 1), (32, 64, 1), (64, 0, 1), (16, 48, 2), (8, 300, 3)]


# ---- the kernel before issue 22, as it was on main -----------------------------------------
@triton.jit
def _old_kernel(
    q_ptr,
    kv_ptr,
    o_ptr,
    cu_ptr,
    starts_ptr,
    tables_ptr,
    layer,
    scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kl,
    stride_kkv,
    stride_kt,
    stride_kh,
    stride_tb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    mblock = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    first = tl.load(cu_ptr + seq).to(tl.int32)
    length = tl.load(cu_ptr + seq + 1).to(tl.int32) - first
    start = tl.load(starts_ptr + seq).to(tl.int32)
    m0 = mblock * BLOCK_M
    if m0 < length:
        kvh = head // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        mmask = offs_m < length
        rows = (first + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=mmask[:, None],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        end = start + tl.minimum(m0 + BLOCK_M, length)  # keys past the tile's last row: masked
        head_base = kv_ptr + layer * stride_kl + kvh * stride_kh
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            valid = offs_n < end
            block = tl.load(
                tables_ptr + seq * stride_tb + offs_n // BLOCK_SIZE, mask=valid, other=0
            )
            tok = head_base + block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
            k = tl.load(tok[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(tok[:, None] + stride_kkv + offs_d[None, :], mask=valid[:, None], other=0.0)
            keep = (start + offs_m[:, None] >= offs_n[None, :]) & valid[None, :]
            m_i, l_i, acc = online_softmax_step(q, k, v, keep, m_i, l_i, acc, scale, IEEE)
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            res.to(o_ptr.dtype.element_ty),
            mask=mmask[:, None],
        )


def old_context_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """The kernel varlen_context_attention launched before issue 22 (same contract)."""
    n, hq, d = q.shape
    _, _, _, block_size, hkv, _ = kv.shape
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    # a few new tokens over a long context (a prefix-cache hit): smaller query tiles give the
    # GPU's 132 SMs more programs (128 tokens x 32 heads: 64 programs at 64 rows, 128 at 32)
    block_m = 32 if max_seqlen <= 256 else 64
    grid = (triton.cdiv(max_seqlen, block_m), hq, cu_seqlens.numel() - 1)
    _old_kernel[grid](
        q,
        kv,
        out,
        cu_seqlens,
        starts,
        block_tables,
        layer,
        scale if scale is not None else d**-0.5,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        kv.stride(4),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=hq // hkv,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=64 if d <= 64 else 32,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    return out


def make_set(own: int, ctx: int, seqs: int, width: int, shape: dict, gen: torch.Generator) -> tuple:
    """Inputs of one case: its own pool (1 layer, NaN in block 0 and nowhere read), distinct
    random blocks per sequence in tables `width` blocks wide (padded with 0), q; -> the
    positional arguments of both launchers."""
    hq, hkv, d, bs, dtype, dev = (shape[k] for k in ("hq", "hkv", "d", "bs", "dtype", "device"))
    need = blocks_for(ctx + own, bs)
    kv = torch.randn((seqs * need + 1, 1, 2, bs, hkv, d), generator=gen).to(dev, dtype)
    kv[0] = float("nan")
    tables = torch.zeros((seqs, max(width, need)), dtype=torch.long)
    tables[:, :need] = (torch.randperm(seqs * need, generator=gen) + 1).view(seqs, need)
    tables = tables.to(dev)
    q = torch.randn((seqs * own, hq, d), generator=gen).to(dev, dtype)
    cu = torch.arange(0, seqs * own + 1, own, device=dev)
    starts = torch.full((seqs,), ctx, dtype=torch.int32, device=dev)
    return q, kv, 0, cu, starts, tables, own


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny fp32 shape for the interpreter")
    ap.add_argument("--sets", type=int, default=8, help="input sets the timed calls rotate over")
    ap.add_argument("--warps", type=int, default=None, help="num_warps of the new split kernel")
    ap.add_argument("--stages", type=int, default=2, help="num_stages of the new split kernel")
    ap.add_argument("--splits", type=int, default=None, help="force the new kernel's splits")
    ap.add_argument("--rows", type=int, default=None, help="rows of the new kernel's tiles")
    ap.add_argument(
        "--table-blocks",
        type=int,
        default=0,
        help="pad every block table to this width (a prefill graph's: max positions / block\n"
        "size, e.g. 128 for 2,048 positions); default: as wide as the context",
    )
    ap.add_argument("--out", type=Path, default=None, help="write every result here as JSON")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("bench/context_kernel.py needs CUDA (on CPU: TRITON_INTERPRET=1 ... --small)")
    if args.small:
        shape = dict(hq=8, hkv=2, d=64, bs=16, dtype=torch.float32)
        cases, sets = SMALL_CASES, min(args.sets, 2)
    else:
        shape = dict(hq=32, hkv=4, d=64, bs=16, dtype=torch.bfloat16)
        cases, sets = CASES, args.sets
    shape["device"] = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator().manual_seed(0)
    results = []
    for own, ctx, seqs in cases:
        inputs = [make_set(own, ctx, seqs, args.table_blocks, shape, gen) for _ in range(sets)]

        def new(*a) -> torch.Tensor:  # type: ignore[no-untyped-def]
            opts = dict(
                splits=args.splits, num_warps=args.warps, num_stages=args.stages, rows=args.rows
            )
            return _context_attention(*a, **opts)

        old_out, new_out = old_context_attention(*inputs[0]), new(*inputs[0])
        q, kv, _, _, _, tables, _ = inputs[0]
        ref = torch.cat(
            [
                context_attention(q[i * own : (i + 1) * own].float(), kv.float(), 0, tables[i], ctx)
                for i in range(seqs)
            ]
        )
        times = {}
        for name, fn in (("old", old_context_attention), ("new", new)):
            rotation = itertools.cycle(inputs)
            times[name] = timer(lambda fn=fn, rotation=rotation: fn(*next(rotation)), cuda)
        hq, hkv, d = shape["hq"], shape["hkv"], shape["d"]
        block_q, _ = context_tiles(hq, hkv, d, shape["dtype"] == torch.float32, own, args.rows)
        tiles = triton.cdiv(own, block_q) * hkv * seqs
        sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 132
        splits = args.splits or context_splits(tiles, tables.shape[1] * shape["bs"], sms)
        row = {
            "own": own,
            "ctx": ctx,
            "seqs": seqs,
            "table_blocks": tables.shape[1],
            "block_q": block_q,
            "splits": splits,
            "programs": tiles * splits,
            "old_us": round(times["old"], 2),
            "new_us": round(times["new"], 2),
            "speedup": round(times["old"] / times["new"], 2),
            "rel_new_old": rel(new_out, old_out),
            "rel_new_ref": rel(new_out, ref),
            "rel_old_ref": rel(old_out, ref),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'own':>5} {'ctx':>5} {'seqs':>4} {'splits':>6} {'old us':>9} {'new us':>9} {'x':>6}")
    for r in results:
        print(
            f"{r['own']:>5} {r['ctx']:>5} {r['seqs']:>4} {r['splits']:>6} {r['old_us']:>9.1f} "
            f"{r['new_us']:>9.1f} {r['speedup']:>6.2f}"
        )
    if args.out is not None:
        meta = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (interpreter)"}
        meta.update(
            warps=args.warps or "kernel's choice",
            stages=args.stages,
            dtype=str(shape["dtype"]),
            sets=sets,
        )
        args.out.write_text(json.dumps({"meta": meta, "cases": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
