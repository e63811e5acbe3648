"""The Triton kernels of the paged-context prefill attention (context_attention.py launches them
and says how they split the work): `context_split`, a program per (query tile, KV head, sequence,
split of the keys) folding its keys from the pool through the block table, and `context_merge`,
which combines the fp32 partials of a tile's splits. Device code only: the tile sizes, split
counts and constants (SPLIT_KEYS) come in as arguments from the launcher.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def context_split(
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
    window,
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
    SLIDING: tl.constexpr,
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
    end = start + tl.minimum(m0 + BLOCK_Q, length)  # the tile's keys: k0 .. its last position
    k0 = _first_key(start + m0, window, BLOCK_N, SLIDING)
    if m0 < length and split < tl.minimum((end - k0 + SPLIT_KEYS - 1) // SPLIT_KEYS, num_splits):
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
        pos = start + qi  # each row's position: it sees keys 0 (or pos - window + 1) .. pos
        # keys [k0, end) of the tile (past its last query every key is masked; before k0 its
        # first query's window), split evenly in whole BLOCK_N tiles over the splits it uses: of
        # the launch's, one per SPLIT_KEYS keys (a short context takes one, written straight to
        # the output; the merge skips its tokens). A used split past `end` is empty and stores
        # m -inf, l 0, acc 0
        used = tl.minimum((end - k0 + SPLIT_KEYS - 1) // SPLIT_KEYS, num_splits)
        chunk = ((end - k0 + used - 1) // used + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = k0 + split * chunk
        hi = tl.minimum(lo + chunk, end)
        # keys from the tile's last position's window start to its first position are seen by
        # every row: the whole BLOCK_N tiles among them [u0, u1) need no mask
        u0 = lo
        if SLIDING:  # the last row (position end - 1) sees keys from end - window on
            ahead = tl.maximum(end - window - lo + BLOCK_N - 1, 0) // BLOCK_N * BLOCK_N
            u0 = tl.minimum(lo + ahead, hi)
        u1 = u0 + tl.maximum(tl.minimum(hi, start + m0 + 1) - u0, 0) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
        head_base = kv_ptr + layer * stride_kl + kvh * stride_kh
        table = tables_ptr + seq * stride_tb
        if SLIDING:  # keys some rows' windows have left behind
            m_i, l_i, acc = _fold_masked(
                q,
                m_i,
                l_i,
                acc,
                qk_scale,
                head_base,
                table,
                lo,
                u0,
                pos,
                window,
                offs_d,
                stride_kb,
                stride_kt,
                stride_kkv,
                BLOCK_SIZE,
                BLOCK_N,
                SLIDING,
                IEEE,
            )
        for n0 in range(u0, u1, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            block = tl.load(table + offs_n // BLOCK_SIZE)
            tok = head_base + block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
            k = tl.load(tok[:, None] + offs_d[None, :])
            v = tl.load(tok[:, None] + stride_kkv + offs_d[None, :])
            m_i, l_i, acc = _fold(q, k, v, None, m_i, l_i, acc, qk_scale, False, IEEE)
        # the diagonal: keys past some rows' positions
        m_i, l_i, acc = _fold_masked(
            q,
            m_i,
            l_i,
            acc,
            qk_scale,
            head_base,
            table,
            u1,
            hi,
            pos,
            window,
            offs_d,
            stride_kb,
            stride_kt,
            stride_kkv,
            BLOCK_SIZE,
            BLOCK_N,
            SLIDING,
            IEEE,
        )
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
def _first_key(first_pos, window, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """The first key a query tile reads: 0, or with a sliding window the start of the BLOCK_N
    tile holding its first query's (at `first_pos`) earliest key."""
    k0 = first_pos * 0
    if SLIDING:
        k0 = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    return k0


@triton.jit
def _fold_masked(
    q,
    m_i,
    l_i,
    acc,
    qk_scale,
    head_base,
    table,
    lo,
    hi,
    pos,
    window,
    offs_d,
    stride_kb,
    stride_kt,
    stride_kkv,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Fold keys [lo, hi) from the pool into the rows at positions `pos`, each keeping the keys
    j <= pos (and, SLIDING, j > pos - window)."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < hi
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=valid, other=0)
        tok = head_base + block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
        k = tl.load(tok[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(tok[:, None] + stride_kkv + offs_d[None, :], mask=valid[:, None], other=0.0)
        keep = (offs_n[None, :] <= pos[:, None]) & valid[None, :]
        if SLIDING:
            keep &= offs_n[None, :] > pos[:, None] - window
        m_i, l_i, acc = _fold(q, k, v, keep, m_i, l_i, acc, qk_scale, True, IEEE)
    return m_i, l_i, acc


@triton.jit
def _write_rows(out, acc, l_i, rmask):
    """A tile's finished rows: acc / l to `out` (pointers [rows, HEAD_DIM]) where `rmask`."""
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out, res.to(out.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def context_merge(
    part_o_ptr,
    part_ml_ptr,
    o_ptr,
    cu_ptr,
    starts_ptr,
    window,
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
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
):
    token = tl.program_id(0)
    kvh = tl.program_id(1)
    # the token's sequence (the number of sequences ending at or before it), its query tile's
    # keys and so the splits that tile used (as context_split counts them)
    offs_s = tl.arange(0, SEQS_PAD)
    ends = tl.load(cu_ptr + 1 + offs_s, mask=offs_s < num_seqs, other=2**30)
    seq = tl.minimum(tl.sum((ends <= token).to(tl.int32), 0), num_seqs - 1)
    first = tl.load(cu_ptr + seq).to(tl.int32)
    length = tl.load(cu_ptr + seq + 1).to(tl.int32) - first
    m0 = (token - first) // BLOCK_Q * BLOCK_Q
    start = tl.load(starts_ptr + seq).to(tl.int32)
    end = start + tl.minimum(m0 + BLOCK_Q, length)
    k0 = _first_key(start + m0, window, BLOCK_N, SLIDING)
    used = tl.minimum((end - k0 + SPLIT_KEYS - 1) // SPLIT_KEYS, num_splits)
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


__all__ = ["context_merge", "context_split"]
