"""Paged KV cache operations on the raw pool tensor.

Layout (fixed, shared with the pool and the IPC layer): one contiguous tensor
`kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, index 0 = K and 1 = V on dim 2,
so one block's K and V for every layer is one contiguous byte range. Slot `s` is block
`s // block_size`, offset `s % block_size`.

Every function here is vectorized: one indexed write or gather per call, never a Python loop per
block or per token. Block-table rows shorter than the widest row are padded with any valid block id
(0 is customary); positions at or past a row's `seq_len` are masked, so whatever those blocks hold,
NaN included, never reaches the output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KV_DIMS = 6  # (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)


def kv_shape(
    num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int, int]:
    """Shape of a pool tensor with these dimensions (the layout documented above)."""
    return (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)


def blocks_for(num_positions: int, block_size: int) -> int:
    """Blocks that hold `num_positions` positions (the project's one ceil-div of a length)."""
    return -(-num_positions // block_size)


def slot_of(blocks, position, block_size: int):  # type: ignore[no-untyped-def]
    """Slot of `position` in a sequence that owns `blocks` in order: block `position //
    block_size`, offset `position % block_size`. Ints, or a LongTensor of positions over a
    LongTensor of blocks (the project's one slot formula)."""
    return blocks[position // block_size] * block_size + position % block_size


def slots_for(
    block_ids: Sequence[int] | torch.Tensor,
    start: int,
    count: int,
    block_size: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Slots of token positions `start .. start+count-1` of a sequence that owns `block_ids` in order.

    Returns LongTensor[count] on `device` (default: block_ids' device, CPU for a list). The blocks
    must cover position `start + count - 1`; an IndexError says otherwise.
    """
    blocks = torch.as_tensor(block_ids, dtype=torch.long, device=device)
    positions = torch.arange(start, start + count, dtype=torch.long, device=blocks.device)
    needed = blocks_for(start + count, block_size)
    if needed > blocks.numel():
        raise IndexError(
            f"positions up to {start + count - 1} need {needed} blocks of {block_size}, "
            f"but the sequence owns {blocks.numel()}"
        )
    return slot_of(blocks, positions, block_size)


def scatter_kv(
    kv: torch.Tensor, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write `k`, `v` ([T, num_kv_heads, head_dim]) of one layer into slots `slot_mapping` ([T]).

    Values are cast to the pool's dtype. Slots must be distinct (a repeated slot keeps one of the
    writes, unspecified which).
    """
    block_size = kv.shape[3]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    kv[blocks, layer, 0, offsets] = k.to(kv.dtype)
    kv[blocks, layer, 1, offsets] = v.to(kv.dtype)


def gather_kv(
    kv: torch.Tensor, layer: int, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer for each row's blocks: each [B, M*block_size, num_kv_heads, head_dim].

    Rows are laid out in block-table order, so position p of row b is index p. Callers mask
    positions at or past the row's sequence length.
    """
    b, m = block_tables.shape
    _, _, _, block_size, heads, dim = kv.shape
    k = kv[block_tables, layer, 0].reshape(b, m * block_size, heads, dim)
    v = kv[block_tables, layer, 1].reshape(b, m * block_size, heads, dim)
    return k, v


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int = 0,
) -> torch.Tensor:
    """One query token per row attending over its paged cache: q [B, Hq, D] -> [B, Hq, D].

    Grouped-query attention: query head h reads KV head h // (Hq // Hkv). Positions >= seq_lens[b]
    are masked out, and with a sliding `window` W > 0 so are those < seq_lens[b] - W (the query
    at position seq_lens[b] - 1 sees W keys, itself included): scores to -inf, values to 0, so
    garbage in unused slots cannot leak. Scores and softmax are computed in fp32; the result has
    q's dtype. Each row's result depends only on its
    own q, block table and length (no cross-row reduction).
    """
    b, hq, d = q.shape
    k, v = gather_kv(kv, layer, block_tables)
    hkv = k.shape[2]
    group = hq // hkv
    length = k.shape[1]
    at = torch.arange(length, device=q.device)[None, :]
    lens = seq_lens.to(q.device)[:, None]
    valid = at < lens  # [B, L]
    if window:
        valid &= at >= lens - window
    qf = q.float().view(b, hkv, group, d)
    kf = k.float()
    vf = v.float().masked_fill(~valid[:, :, None, None], 0.0)
    scores = torch.einsum("bhgd,blhd->bhgl", qf, kf) * (scale if scale is not None else d**-0.5)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, vf)
    return out.reshape(b, hq, d).to(q.dtype)


def causal_mask(positions: torch.Tensor, keys: int, window: int = 0) -> torch.Tensor:
    """[len(positions), keys] bool: the query at position i may see key j, i.e. j <= i and, with a
    sliding `window` W > 0, i - j < W (transformers' sliding-window rule)."""
    j = torch.arange(keys, device=positions.device)[None, :]
    i = positions[:, None]
    return (j <= i) & (j > i - window) if window else j <= i


def context_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    start: int,
    *,
    scale: float | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its whole paged cache: q [L, Hq, D] holds
    positions start .. start+L-1, whose K/V (and the `start` positions before them: a cached
    prefix, or earlier chunks) are already in `kv` through `block_table` [M] -> [L, Hq, D].

    Query i attends to positions 0 .. start+i (grouped-query: head h reads KV head h // group),
    with a sliding `window` W > 0 only to those above start+i-W; computed by torch's SDPA in q's
    dtype, as the dense prefill computes it.
    """
    n = q.shape[0]
    end = start + n
    k, v = gather_kv(kv, layer, block_table[None, : blocks_for(end, kv.shape[3])])
    k, v = k[0, :end].to(q.dtype), v[0, :end].to(q.dtype)
    allowed = causal_mask(torch.arange(start, end, device=q.device), end, window)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=allowed,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
