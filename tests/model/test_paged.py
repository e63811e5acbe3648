"""Paged KV primitives on the raw pool tensor, and paged decode against a dense forward."""

from __future__ import annotations

import pytest
import torch

from common.model import LlamaModel, gather_kv, kv_shape, paged_attention, scatter_kv, slots_for

TOL = 1e-4  # max abs logit difference, fp32, paged decode vs dense forward


def test_slots_for_maps_positions_through_the_block_list() -> None:
    slots = slots_for([7, 2, 5], start=2, count=5, block_size=3)
    # positions 2..6 -> blocks [7, 2, 2, 2, 5], offsets [2, 0, 1, 2, 0]
    assert slots.tolist() == [23, 6, 7, 8, 15]


def test_slots_for_refuses_positions_past_the_blocks() -> None:
    with pytest.raises(IndexError, match="need 3 blocks"):
        slots_for([0, 1], start=0, count=9, block_size=4)


def test_scatter_then_gather_returns_each_token_at_its_position() -> None:
    g = torch.Generator().manual_seed(0)
    block_size, heads, dim = 4, 2, 3
    kv = torch.full(kv_shape(10, 2, block_size, heads, dim), float("nan"))
    tables = torch.tensor([[9, 3, 0], [4, 1, 7]])
    lens = [11, 6]
    for row, n in enumerate(lens):
        k, v = torch.randn(2, n, heads, dim, generator=g)
        scatter_kv(kv, 1, slots_for(tables[row], 0, n, block_size), k, v)
        gk, gv = gather_kv(kv, 1, tables)
        assert gk.shape == (2, 3 * block_size, heads, dim)
        torch.testing.assert_close(gk[row, :n], k, rtol=0, atol=0)
        torch.testing.assert_close(gv[row, :n], v, rtol=0, atol=0)
    assert torch.isnan(kv[:, 0]).all(), "layer 0 must stay untouched"


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Hq, D], k/v [L, Hkv, D] -> [Hq, D], GQA by repeating KV heads."""
    rep = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    probs = torch.softmax(torch.einsum("hd,lhd->hl", q, k) / q.shape[-1] ** 0.5, dim=-1)
    return torch.einsum("hl,lhd->hd", probs, v)


def test_paged_attention_matches_dense_gqa_and_ignores_garbage_past_seq_len() -> None:
    g = torch.Generator().manual_seed(1)
    block_size, hq, hkv, dim = 4, 6, 2, 8
    kv = torch.full(kv_shape(12, 1, block_size, hkv, dim), float("nan"))
    tables = torch.tensor([[5, 2, 11], [0, 8, 0], [7, 0, 0]])  # rows padded with block 0
    lens = torch.tensor([12, 5, 1])
    keys, values = [], []
    for row, n in enumerate(lens.tolist()):
        k, v = torch.randn(2, n, hkv, dim, generator=g)
        scatter_kv(kv, 0, slots_for(tables[row], 0, n, block_size), k, v)
        keys.append(k)
        values.append(v)
    q = torch.randn(3, hq, dim, generator=g)
    out = paged_attention(q, kv, 0, tables, lens)
    assert not torch.isnan(out).any()
    for row in range(3):
        expected = _dense_attention(q[row], keys[row], values[row])
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)


def test_paged_decode_equals_dense_forward_across_block_boundaries(tiny: LlamaModel) -> None:
    """Prefill a prefix of each sequence, then teacher-force the rest through batched decode
    steps; every step's logits must equal the dense (no cache) forward at that position."""
    block_size = 4
    g = torch.Generator().manual_seed(2)
    prompt_lens = [1, 3, 4, 5, 9, 2]
    total_lens = [11, 8, 13, 6, 17, 10]
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in total_lens]
    width = max(-(-n // block_size) for n in total_lens)
    kv = tiny.new_kv_cache(width * len(seqs) + 1, block_size).fill_(float("nan"))
    perm = torch.randperm(width * len(seqs), generator=g) + 1  # block 0 stays NaN padding
    tables = perm.view(len(seqs), width)
    dense = [tiny.forward_dense(s) for s in seqs]

    for row, p in enumerate(prompt_lens):
        logits = tiny.prefill(seqs[row][:p], slots_for(tables[row], 0, p, block_size), kv)
        assert (logits - dense[row][p - 1]).abs().max() <= TOL

    for step in range(max(t - p for t, p in zip(total_lens, prompt_lens, strict=True))):
        rows = [r for r in range(len(seqs)) if prompt_lens[r] + step < total_lens[r]]
        positions = torch.tensor([prompt_lens[r] + step for r in rows])  # mixed lengths
        used = [int(pos) // block_size + 1 for pos in positions]
        block_tables = torch.zeros(len(rows), max(used), dtype=torch.long)  # pad: NaN block 0
        for i, r in enumerate(rows):
            block_tables[i, : used[i]] = tables[r, : used[i]]
        slots = torch.cat(
            [
                slots_for(tables[r], int(pos), 1, block_size)
                for r, pos in zip(rows, positions, strict=True)
            ]
        )
        tokens = torch.stack([seqs[r][int(pos)] for r, pos in zip(rows, positions, strict=True)])
        logits = tiny.decode_step(tokens, positions, slots, block_tables, positions + 1, kv)
        assert not torch.isnan(logits).any()
        for i, r in enumerate(rows):
            diff = (logits[i] - dense[r][positions[i]]).abs().max().item()
            assert diff <= TOL, f"row {r} position {int(positions[i])}: max abs diff {diff}"
