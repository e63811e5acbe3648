"""Causal varlen prefill attention: several sequences concatenated along the token axis
(cumulative lengths `cu_seqlens`), each attending only to its own earlier tokens, folded tile by
tile with the same flash-attention step as the paged-decode kernel (attention.py).

`varlen_context_attention` is the same with a paged context: each sequence's new tokens sit after
`starts[s]` positions whose K/V is already in the pool (a cached prefix, earlier chunks of a long
prompt), and every key, the new tokens' own included, is read from the pool through the block
table, as the paged-decode kernel reads it. It is laid out like the paged-decode kernel:

- a program takes one (query tile, KV head, sequence, split of the keys); its rows are BLOCK_Q
  queries x the GQA group of that KV head (padded to a power of two and masked), 128 rows in
  bf16 (64 for head_dim > 64, 32 in fp32), so each K/V tile and block-table entry is loaded once
  for the whole group, and row r's causal limit is its own position start + query index;
- a tile's keys [0, start + its last query + 1) are split evenly, in whole BLOCK_N tiles, over
  the splits it uses (flash-decoding): of the launch's, one per SPLIT_KEYS of those keys, counted
  on the device; the key tiles below the tile's first position need no mask, only the last one
  or two (the diagonal) are masked, and keys past the last query are never read. A used split
  that gets no keys stores m = -inf, l = 0; an unused one does nothing;
- a tile of one split writes its rows of the output; with more, each split writes fp32 partial
  (acc, m, l) and `_context_merge` (one program per token and KV head, counting its tile's
  splits the same way) combines them.

The number of splits comes from host values only (`context_splits`: the query tiles, KV heads
and sequences of the launch against the SM count, the block table's width), so a prefill CUDA
graph captured once replays right for any lengths and starts of its shapes; the split ranges
are computed on the device from each sequence's start and length. Scores use exp2 with the
scale folded into log2 e; fp32 inputs use IEEE fp32 dots (the fp32 greedy-equality tests),
bf16 the tensor cores.
"""

from __future__ import annotations

import functools

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


LOG2E = 1.4426950408889634
NUM_SMS = 132  # an H200's; the split heuristic's target where the device reports none (the CPU)
MIN_SPLIT_KEYS = 128  # context keys (of the widest context the block table holds) per split
# keys a query tile's split takes at the least, on the device: a tile with fewer than twice as
# many uses one split and writes its output directly (a short prompt in a graph captured for
# long contexts: no partials, no merge)
SPLIT_KEYS = 256
MAX_SPLITS = 16


@triton.jit
def _fold(q, k, v, keep, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """`online_softmax_step` in base 2 (`qk_scale` includes log2 e; m_i is in base 2 too), with
    `keep` applied only when MASKED. A row whose keys are all masked so far keeps m -inf, l 0 and
    acc 0 instead of turning NaN: a split of the keys can lie wholly past a row's position."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0) if MASKED else m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p, v, input_precision="ieee") if IEEE else tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _context_split(
    q_ptr,
    kv_ptr,
    o_ptr,
    part_o_ptr,
    part_ml_ptr,
    cu_ptr,
    starts_ptr,
    tables_ptr,
    layer,
    qk_scale,
    num_tokens,
    num_heads,
    num_splits,
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
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    # the causal triangle's last (longest) query tiles are launched first
    mblock = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    first = tl.load(cu_ptr + seq).to(tl.int32)
    length = tl.load(cu_ptr + seq + 1).to(tl.int32) - first
    m0 = mblock * BLOCK_Q
    start = tl.load(starts_ptr + seq).to(tl.int32)
    end = start + tl.minimum(m0 + BLOCK_Q, length)  # the tile's keys: 0 .. its last position
    if m0 < length and split < tl.minimum((end + SPLIT_KEYS - 1) // SPLIT_KEYS, num_splits):
        # row r: query m0 + r // GROUP_PAD of the tile, query head kvh * GROUP + r % GROUP_PAD
        offs_r = tl.arange(0, BLOCK_Q * GROUP_PAD)
        qi = m0 + offs_r // GROUP_PAD
        g = offs_r % GROUP_PAD
        heads = kvh * GROUP + g
        rmask = (qi < length) & (g < GROUP)
        tokens = (first + qi).to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=rmask[:, None],
            other=0.0,
        )
        pos = start + qi  # each row's position: it sees keys 0 .. pos
        # keys [0, end) of the tile (past its last query every key is masked), split evenly in
        # whole BLOCK_N tiles over the splits it uses: of the launch's, one per SPLIT_KEYS keys
        # (a short context takes one, written straight to the output; the merge skips its
        # tokens). A used split past `end` is empty and stores m -inf, l 0, acc 0
        used = tl.minimum((end + SPLIT_KEYS - 1) // SPLIT_KEYS, num_splits)
        chunk = ((end + used - 1) // used + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, end)
        # keys below the tile's first position are seen by every row: those tiles need no mask
        mid = lo + tl.maximum(tl.minimum(hi, start + m0 + 1) - lo, 0) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
        head_base = kv_ptr + layer * stride_kl + kvh * stride_kh
        table = tables_ptr + seq * stride_tb
        for n0 in range(lo, mid, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            block = tl.load(table + offs_n // BLOCK_SIZE)
            tok = head_base + block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
            k = tl.load(tok[:, None] + offs_d[None, :])
            v = tl.load(tok[:, None] + stride_kkv + offs_d[None, :])
            m_i, l_i, acc = _fold(q, k, v, None, m_i, l_i, acc, qk_scale, False, IEEE)
        for n0 in range(mid, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            valid = offs_n < hi
            block = tl.load(table + offs_n // BLOCK_SIZE, mask=valid, other=0)
            tok = head_base + block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
            k = tl.load(tok[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(tok[:, None] + stride_kkv + offs_d[None, :], mask=valid[:, None], other=0.0)
            keep = (offs_n[None, :] <= pos[:, None]) & valid[None, :]
            m_i, l_i, acc = _fold(q, k, v, keep, m_i, l_i, acc, qk_scale, True, IEEE)
        rows = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        if SPLIT:  # a launch of several splits: partials, unless this tile uses one
            if used > 1:
                part = (split * num_tokens + tokens) * num_heads + heads  # [S, N, Hq] row-major
                part_o = part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :]
                tl.store(part_o, acc, mask=rmask[:, None])
                tl.store(part_ml_ptr + part * 2, m_i, mask=rmask)
                tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=rmask)
            else:
                _write_rows(o_ptr + rows, acc, l_i, rmask)
        else:
            _write_rows(o_ptr + rows, acc, l_i, rmask)


@triton.jit
def _write_rows(out, acc, l_i, rmask):
    """A tile's finished rows: acc / l to `out` (pointers [rows, HEAD_DIM]) where `rmask`."""
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out, res.to(out.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _context_merge(
    part_o_ptr,
    part_ml_ptr,
    o_ptr,
    cu_ptr,
    starts_ptr,
    num_seqs,
    num_tokens,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    SEQS_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    kvh = tl.program_id(1)
    # the token's sequence (the number of sequences ending at or before it), its query tile's
    # keys and so the splits that tile used (as _context_split counts them)
    offs_s = tl.arange(0, SEQS_PAD)
    ends = tl.load(cu_ptr + 1 + offs_s, mask=offs_s < num_seqs, other=2**30)
    seq = tl.minimum(tl.sum((ends <= token).to(tl.int32), 0), num_seqs - 1)
    first = tl.load(cu_ptr + seq).to(tl.int32)
    length = tl.load(cu_ptr + seq + 1).to(tl.int32) - first
    m0 = (token - first) // BLOCK_Q * BLOCK_Q
    end = tl.load(starts_ptr + seq).to(tl.int32) + tl.minimum(m0 + BLOCK_Q, length)
    used = tl.minimum((end + SPLIT_KEYS - 1) // SPLIT_KEYS, num_splits)
    # tokens past the last sequence have no partials; a tile of one split wrote its output
    if token < tl.load(cu_ptr + num_seqs) and used > 1:
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + offs_g
        gmask = offs_g < GROUP
        token64 = token.to(tl.int64)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for s in range(used):
            part = (s * num_tokens + token64) * num_heads + heads  # [S, N, Hq] row-major
            m_s = tl.load(part_ml_ptr + part * 2, mask=gmask, other=float("-inf"))
            l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=gmask, other=0.0)
            o_s = tl.load(
                part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                mask=gmask[:, None],
                other=0.0,
            )
            m_new = tl.maximum(m_i, m_s)
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # a padded head: never any key
            a = tl.exp2(m_i - m_use)
            b = tl.exp2(m_s - m_use)
            l_i = l_i * a + l_s * b
            acc = acc * a[:, None] + o_s * b[:, None]
            m_i = m_new
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            o_ptr + token64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            res.to(o_ptr.dtype.element_ty),
            mask=gmask[:, None],
        )


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def context_tiles(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    fp32: bool,
    max_seqlen: int,
    rows: int | None = None,
) -> tuple[int, int]:
    """(BLOCK_Q, GROUP_PAD) of the context kernel: a tile's rows are BLOCK_Q queries x the
    GROUP_PAD (GQA group padded to a power of two) query heads of one KV head, `rows` of them
    (default 128; 64 for head_dim > 64, 32 for fp32, whose IEEE dots spill registers past that),
    fewer when the longest run is shorter, never fewer than 16 (the least M of tl.dot)."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    if rows is None:
        rows = 32 if fp32 else 64 if head_dim > 64 else 128
    block_q = max(rows // group_pad, 1)
    block_q = min(block_q, max(triton.next_power_of_2(max_seqlen), -(-16 // group_pad)))
    return block_q, group_pad


def context_splits(num_tiles: int, max_keys: int, num_sms: int) -> int:
    """Splits of each tile's keys, from host values only (fixed for a CUDA-graph capture): 1 when
    the `num_tiles` programs (query tiles x KV heads x sequences) fill the `num_sms` SMs, else
    about two waves' worth, at most one split per MIN_SPLIT_KEYS of `max_keys` (the widest
    context the block table holds) and at most MAX_SPLITS."""
    if num_tiles >= num_sms:
        return 1
    return max(1, min(-(-2 * num_sms // num_tiles), max_keys // MIN_SPLIT_KEYS, MAX_SPLITS))


def _context_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    rows: int | None = None,
) -> torch.Tensor:
    """`varlen_context_attention` with its launch choices open (the tests and the bench force
    them; None takes `context_splits`'s splits, and 8 warps for tiles of 128 x 64 or more and in
    fp32, else 4: compiled for sm_90 by triton 3.9, 4 warps at 128 rows x 64 spill registers)."""
    n, hq, d = q.shape
    _, _, _, block_size, hkv, _ = kv.shape
    num_seqs = cu_seqlens.numel() - 1
    fp32 = q.dtype == torch.float32
    block_q, group_pad = context_tiles(hq, hkv, d, fp32, max_seqlen, rows)
    q_tiles = triton.cdiv(max_seqlen, block_q)
    if num_warps is None:
        num_warps = 8 if fp32 or block_q * group_pad * d >= 128 * 64 else 4
    if splits is None:
        tiles = q_tiles * hkv * num_seqs
        splits = context_splits(tiles, block_tables.shape[1] * block_size, _sm_count(q.device))
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if splits > 1:
        part_o = torch.empty((splits, n, hq, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((splits, n, hq, 2), dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # not read or written
    group = hq // hkv
    _context_split[(q_tiles, hkv, num_seqs * splits)](
        q,
        kv,
        out,
        part_o,
        part_ml,
        cu_seqlens,
        starts,
        block_tables,
        layer,
        (scale if scale is not None else d**-0.5) * LOG2E,
        n,
        hq,
        splits,
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
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_N=64 if d <= 64 else 32,
        SPLIT_KEYS=SPLIT_KEYS,
        SPLIT=splits > 1,
        IEEE=fp32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _context_merge[(n, hkv)](
            part_o,
            part_ml,
            out,
            cu_seqlens,
            starts,
            num_seqs,
            n,
            hq,
            splits,
            out.stride(0),
            out.stride(1),
            GROUP=group,
            GROUP_PAD=group_pad,
            HEAD_DIM=d,
            BLOCK_Q=block_q,
            SPLIT_KEYS=SPLIT_KEYS,
            SEQS_PAD=max(2, triton.next_power_of_2(num_seqs)),
            num_warps=1 if group_pad * d <= 512 else 2,
        )
    return out


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

    The launch (grid, splits, scratch sizes) depends only on q's and kv's shapes, the number of
    sequences, W and `max_seqlen`, never on the values of `cu_seqlens` or `starts`, so a CUDA
    graph captured once replays for other lengths and contexts of the same shapes. A sequence of
    length 0 reads and writes nothing; rows past cu_seqlens[-1] are left unwritten.
    """
    return _context_attention(
        q, kv, layer, cu_seqlens, starts, block_tables, max_seqlen, scale=scale
    )


__all__ = [
    "context_splits",
    "context_tiles",
    "varlen_causal_attention",
    "varlen_context_attention",
]
