"""Causal varlen prefill attention: several sequences concatenated along the token axis
(cumulative lengths `cu_seqlens`), each attending only to its own earlier tokens, folded tile by
tile with the same flash-attention step as the paged-decode kernel (attention.py).

`varlen_context_attention` is the same with a paged context: each sequence's new tokens sit after
`starts[s]` positions whose K/V is already in the pool (a cached prefix, earlier chunks of a long
prompt), and every key, the new tokens' own included, is read from the pool through the block
table, as the paged-decode kernel reads it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.model.kernels.attention import online_softmax_step


@triton.jit
def _varlen_causal(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    cu_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    mblock = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    first = tl.load(cu_ptr + seq).to(tl.int32)
    length = tl.load(cu_ptr + seq + 1).to(tl.int32) - first
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
        hi = tl.minimum(m0 + BLOCK_M, length)
        for n0 in range(0, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < length
            cols = (first + offs_n).to(tl.int64)
            k = tl.load(
                k_ptr + cols[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                mask=nmask[:, None],
                other=0.0,
            )
            v = tl.load(
                v_ptr + cols[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                mask=nmask[:, None],
                other=0.0,
            )
            keep = (offs_m[:, None] >= offs_n[None, :]) & nmask[None, :]
            m_i, l_i, acc = online_softmax_step(q, k, v, keep, m_i, l_i, acc, scale, IEEE)
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            res.to(o_ptr.dtype.element_ty),
            mask=mmask[:, None],
        )


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention per sequence of a concatenated batch: q [N, Hq, D], k/v [N, Hkv, D].

    Sequence s holds tokens cu_seqlens[s] .. cu_seqlens[s+1]-1 (int32 or int64, on q's device);
    each token attends to its own sequence's tokens up to itself. Last dims contiguous; returns a
    new [N, Hq, D] tensor of q's dtype.
    """
    n, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    block_m = 64
    grid = (triton.cdiv(max_seqlen, block_m), hq, cu_seqlens.numel() - 1)
    _varlen_causal[grid](
        q,
        k,
        v,
        out,
        cu_seqlens,
        scale if scale is not None else d**-0.5,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=hq // hkv,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=64,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    return out


@triton.jit
def _varlen_context(
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


def varlen_context_attention(
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
    """`varlen_causal_attention` with a paged context: q [N, Hq, D] of sequences concatenated
    (`cu_seqlens`); sequence s's tokens are its positions starts[s] .. starts[s]+len-1, and the
    K/V of its positions 0 .. starts[s]+len-1 (the new tokens' own already stored) is in `kv`
    [num_blocks, layers, 2, block_size, Hkv, D] through `block_tables` [S, W]. Each token attends
    to its sequence's positions up to its own. All on q's device; returns [N, Hq, D] of q's dtype.
    This is `common.model.paged.context_attention` for every sequence at once.
    """
    n, hq, d = q.shape
    _, _, _, block_size, hkv, _ = kv.shape
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    # a few new tokens over a long context (a prefix-cache hit): smaller query tiles give the
    # GPU's 132 SMs more programs (128 tokens x 32 heads: 64 programs at 64 rows, 128 at 32)
    block_m = 32 if max_seqlen <= 256 else 64
    grid = (triton.cdiv(max_seqlen, block_m), hq, cu_seqlens.numel() - 1)
    _varlen_context[grid](
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


__all__ = ["varlen_causal_attention", "varlen_context_attention"]
