"""Causal varlen prefill attention over a paged context, the host side: `varlen_context_attention`
is `varlen_causal_attention` (varlen_attention.py) where each sequence's new tokens sit after
`starts[s]` positions whose K/V is already in the pool (a cached prefix, earlier chunks of a long
prompt), and every key, the new tokens' own included, is read from the pool through the block
table, as the paged-decode kernel reads it. This module chooses the tiles and splits, allocates
the scratch and launches the two Triton kernels of context_kernels.py.

It is laid out like the paged-decode kernel:

- a program takes one (query tile, KV head, sequence, split of the keys); its rows are BLOCK_Q
  queries x the GQA group of that KV head (padded to a power of two and masked), 128 rows in
  bf16 (64 for head_dim > 64, 32 in fp32), so each K/V tile and block-table entry is loaded once
  for the whole group, and row r's causal limit is its own position start + query index;
- a tile's keys [0, start + its last query + 1) are split evenly, in whole BLOCK_N tiles, over
  the splits it uses (flash-decoding): of the launch's, one per SPLIT_KEYS of those keys, counted
  on the device; the key tiles below the tile's first position need no mask, only the last one
  or two (the diagonal) are masked, and keys past the last query are never read. A used split
  that gets no keys stores m = -inf, l = 0; an unused one does nothing;
- with a sliding window W (a plain argument: a graph keeps each layer's), a tile's keys start
  instead at the BLOCK_N tile holding its first query's window start (start + m0 - W + 1), the
  splits are counted over the keys from there, and only the key tiles every row sees (from its
  last query's window start to its first query) go unmasked;
- a tile of one split writes its rows of the output; with more, each split writes fp32 partial
  (acc, m, l) and `context_merge` (one program per token and KV head, counting its tile's
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

from common.model.kernels.context_kernels import context_merge, context_split

LOG2E = 1.4426950408889634
NUM_SMS = 132  # an H200's; the split heuristic's target where the device reports none (the CPU)
MIN_SPLIT_KEYS = 128  # context keys (of the widest context the block table holds) per split
# keys a query tile's split takes at the least, on the device: a tile with fewer than twice as
# many uses one split and writes its output directly (a short prompt in a graph captured for
# long contexts: no partials, no merge)
SPLIT_KEYS = 256
MAX_SPLITS = 16


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
    window: int = 0,
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
    block_n = 64 if d <= 64 else 32
    context_split[(q_tiles, hkv, num_seqs * splits)](
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
        window,
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
        BLOCK_N=block_n,
        SPLIT_KEYS=SPLIT_KEYS,
        SPLIT=splits > 1,
        SLIDING=window > 0,
        IEEE=fp32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        context_merge[(n, hkv)](
            part_o,
            part_ml,
            out,
            cu_seqlens,
            starts,
            window,
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
            BLOCK_N=block_n,
            SLIDING=window > 0,
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
    window: int = 0,
) -> torch.Tensor:
    """`varlen_causal_attention` with a paged context: q [N, Hq, D] of sequences concatenated
    (`cu_seqlens`); sequence s's tokens are its positions starts[s] .. starts[s]+len-1, and the
    K/V of its positions 0 .. starts[s]+len-1 (the new tokens' own already stored) is in `kv`
    [num_blocks, layers, 2, block_size, Hkv, D] through `block_tables` [S, W]. Each token attends
    to its sequence's positions up to its own (with a sliding `window` W > 0, only to the last W
    of them: key tiles wholly before a query tile's windows are never read). All on q's device;
    returns [N, Hq, D] of q's dtype. This is `common.model.paged.context_attention` for every sequence at once.

    The launch (grid, splits, scratch sizes) depends only on q's and kv's shapes, the number of
    sequences, W and `max_seqlen`, never on the values of `cu_seqlens` or `starts`, so a CUDA
    graph captured once replays for other lengths and contexts of the same shapes. A sequence of
    length 0 reads and writes nothing; rows past cu_seqlens[-1] are left unwritten.
    """
    return _context_attention(
        q, kv, layer, cu_seqlens, starts, block_tables, max_seqlen, scale=scale, window=window
    )


__all__ = [
    "context_splits",
    "context_tiles",
    "varlen_context_attention",
]
