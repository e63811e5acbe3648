"""Causal varlen prefill attention: several sequences concatenated along the token axis
(cumulative lengths `cu_seqlens`), each attending only to its own earlier tokens, folded tile by
tile with the same flash-attention step as the paged-decode kernel (attention.py). With a
sliding window W a token sees only its sequence's last W tokens up to itself, and a query tile
starts its keys at the first tile its earliest query sees.

The same attention over a paged context (each sequence's new tokens after positions already in
the pool, every key read through the block table) is `varlen_context_attention`, in
context_attention.py.
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
    window,
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
    SLIDING: tl.constexpr,
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
        lo = 0
        if SLIDING:  # keys before the tile's first query's window are seen by no row of it
            lo = tl.maximum(m0 - window + 1, 0) // BLOCK_N * BLOCK_N
        for n0 in range(lo, hi, BLOCK_N):
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
            if SLIDING:
                keep &= offs_m[:, None] - offs_n[None, :] < window
            m_i, l_i, acc = online_softmax_step(q, k, v, keep, m_i, l_i, acc, scale, IEEE, SLIDING)
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
    window: int = 0,
) -> torch.Tensor:
    """Causal attention per sequence of a concatenated batch: q [N, Hq, D], k/v [N, Hkv, D].

    Sequence s holds tokens cu_seqlens[s] .. cu_seqlens[s+1]-1 (int32 or int64, on q's device);
    each token attends to its own sequence's tokens up to itself, with a sliding `window` W > 0
    only to the last W of them. Last dims contiguous; returns a new [N, Hq, D] tensor of q's dtype.
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
        window,
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
        SLIDING=window > 0,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    return out


__all__ = ["varlen_causal_attention"]
