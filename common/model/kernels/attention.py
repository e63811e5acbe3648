"""Paged-decode attention over the block table, and the flash-attention tile both attention
kernels fold keys with (`online_softmax_step`; the varlen prefill kernel is in varlen_attention.py,
the paged-context one in context_attention.py).

`paged_decode_attention` is `common.model.paged.paged_attention` without the gather: each program
takes one (row, KV head, split of the context) and reads that row's blocks through its block table,
with the GQA query heads of that KV head packed as the rows of one matrix product; a second kernel
merges the splits (flash-decoding). The grid depends only on the table's width, so a CUDA graph
captured at one width replays for every batch of that bucket. A row of length 0 (a padded graph
slot) reads nothing and yields zeros. With a sliding window W (`window`, a plain argument, so
each layer's launch keeps its own in a captured graph) a row reads only its last W positions:
the splits start at the row's window (a launch has one per PARTITION of the window, not of the
table), and the blocks before it are never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PARTITION = 256  # context tokens per split of the paged-decode kernel


@triton.jit
def online_softmax_step(
    q, k, v, keep, m_i, l_i, acc, scale, IEEE: tl.constexpr, EMPTY_ROWS: tl.constexpr = False
):
    """One tile of flash attention: fold keys k / values v [N, D] (where `keep` [M, N]) into the
    running max m_i, sum l_i and output acc of queries q [M, D]; scores and sums in fp32.
    EMPTY_ROWS: a row may have kept no key yet (a sliding window that starts past this tile); it
    then stays at m -inf, l 0, acc 0 instead of turning NaN."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(k))
    s = tl.where(keep, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0) if EMPTY_ROWS else m_new
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p, v, input_precision="ieee") if IEEE else tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _paged_decode_split(
    q_ptr,
    kv_ptr,
    tables_ptr,
    lens_ptr,
    part_o_ptr,
    part_ml_ptr,
    layer,
    scale,
    window,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kl,
    stride_kkv,
    stride_kt,
    stride_kh,
    stride_tb,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    SLIDING: tl.constexpr,
    IEEE: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_kv = tl.num_programs(1)
    seq_len = tl.load(lens_ptr + row).to(tl.int32)
    base = 0
    if SLIDING:  # the query (position seq_len - 1) sees positions seq_len - window .. on
        base = tl.maximum(seq_len - window, 0)
    start = base + split * PARTITION
    end = tl.minimum(start + PARTITION, seq_len)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=(offs_g < GROUP)[:, None],
        other=0.0,
    )
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    head_base = kv_ptr + layer * stride_kl + kvh * stride_kh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        block = tl.load(tables_ptr + row * stride_tb + offs_n // BLOCK_SIZE, mask=valid, other=0)
        tok = head_base + block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
        k = tl.load(tok[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(tok[:, None] + stride_kkv + offs_d[None, :], mask=valid[:, None], other=0.0)
        keep = valid[None, :]
        m_i, l_i, acc = online_softmax_step(q, k, v, keep, m_i, l_i, acc, scale, IEEE, False)
    part = (row * num_kv * GROUP + heads) * num_splits + split  # [GROUP_PAD]
    gmask = offs_g < GROUP
    tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=gmask[:, None])
    tl.store(part_ml_ptr + part * 2, m_i, mask=gmask)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=gmask)


@triton.jit
def _paged_decode_merge(
    part_o_ptr,
    part_ml_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    base = (row * num_heads + head) * num_splits + offs_s
    smask = offs_s < num_splits
    m = tl.load(part_ml_ptr + base * 2, mask=smask, other=float("-inf"))
    lsum = tl.load(part_ml_ptr + base * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # a row of length 0: every split empty
    w = tl.exp(m - m_max)
    o = tl.load(
        part_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=smask[:, None], other=0.0
    )
    total = tl.sum(w * lsum, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + row * stride_ob + head * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty)
    )


def decode_splits(table_width: int, block_size: int, window: int = 0) -> int:
    """Splits of the context for a block table `table_width` blocks wide: one per PARTITION
    positions it holds, or with a sliding `window` > 0 at most one per PARTITION of the window
    (split s then starts s * PARTITION after the row's window does)."""
    keys = table_width * block_size
    return max(1, -(-(min(keys, window) if window else keys) // PARTITION))


def paged_decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """`paged.paged_attention` by kernel: q [B, Hq, D] (last dim contiguous) -> [B, Hq, D].

    `block_tables` [B, W] and `seq_lens` [B] are int32 or int64 on q's device; positions at or past
    a row's length, and with a sliding `window` > 0 those before its last `window`, are never
    read. Scores, softmax and the sum are fp32; the result has q's dtype.
    """
    b, hq, d = q.shape
    _, _, _, block_size, hkv, _ = kv.shape
    group = hq // hkv
    splits = decode_splits(block_tables.shape[1], block_size, window)
    part_o = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((b, hq, splits, 2), dtype=torch.float32, device=q.device)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device) if out is None else out
    ieee = q.dtype == torch.float32
    _paged_decode_split[(b, hkv, splits)](
        q,
        kv,
        block_tables,
        seq_lens,
        part_o,
        part_ml,
        layer,
        scale if scale is not None else d**-0.5,
        window,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        kv.stride(4),
        block_tables.stride(0),
        splits,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BLOCK_N=64 if d <= 64 else 32,
        PARTITION=PARTITION,
        SLIDING=window > 0,
        IEEE=ieee,
        num_warps=4,
    )
    _paged_decode_merge[(b, hq)](
        part_o,
        part_ml,
        out,
        out.stride(0),
        out.stride(1),
        splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
        HEAD_DIM=d,
        num_warps=1,
    )
    return out


__all__ = ["PARTITION", "decode_splits", "online_softmax_step", "paged_decode_attention"]
