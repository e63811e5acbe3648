"""A prefill whose first positions are already in the pool (a cached prefix, earlier chunks)
equals the prefill of the whole prompt: the torch path on any device, against the dense
forward and the plain prefill as references."""

from __future__ import annotations

import itertools

import pytest
import torch

from common.model import LlamaModel, slots_for
from common.model.paged import context_attention

BLOCK = 4


def _whole(model: LlamaModel, prompt: list[int], blocks: list[int]) -> tuple[torch.Tensor, ...]:
    kv = model.new_kv_cache(16, BLOCK)
    slots = slots_for(blocks, 0, len(prompt), BLOCK)
    logits = model.prefill_batch([torch.tensor(prompt)], [slots], kv)
    return logits[0], kv


def _in_pieces(
    model: LlamaModel, prompt: list[int], blocks: list[int], cuts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill positions [0, cuts[0]), then [cuts[0], cuts[1]), ... each over the pool."""
    kv = model.new_kv_cache(16, BLOCK)
    bounds = [0, *cuts, len(prompt)]
    logits = None
    for a, b in itertools.pairwise(bounds):
        slots = slots_for(blocks, a, b - a, BLOCK)
        tokens = torch.tensor(prompt[a:b])
        logits = model.prefill_batch([tokens], [slots], kv, starts=[a], block_tables=[blocks])
    assert logits is not None
    return logits[0], kv


@pytest.mark.parametrize("cuts", [[8], [4, 8], [1], [12], [3, 5, 11]])
def test_pieces_equal_the_whole_prompt(tiny: LlamaModel, cuts: list[int]) -> None:
    prompt = [(7 * i + 3) % tiny.config.vocab_size for i in range(13)]
    blocks = [5, 2, 9, 11]  # scattered, not in order
    ref_logits, ref_kv = _whole(tiny, prompt, blocks)
    logits, kv = _in_pieces(tiny, prompt, blocks, cuts)
    dense = tiny.forward_dense(torch.tensor(prompt))[-1]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, dense, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv[blocks], ref_kv[blocks], rtol=1e-5, atol=1e-5)
    assert int(logits.argmax()) == int(dense.argmax())


def test_a_batch_mixes_context_and_fresh_prompts(tiny: LlamaModel) -> None:
    """Row s of a batch whose prompts have different contexts is prompt s prefilled whole."""
    v = tiny.config.vocab_size
    prompts = [[(5 * i + s) % v for i in range(n)] for s, n in enumerate([9, 6, 12])]
    tables = [[1, 2, 3], [4, 5], [6, 7, 8]]
    starts = [8, 0, 4]
    kv = tiny.new_kv_cache(16, BLOCK)
    for p, t, a in zip(prompts, tables, starts, strict=True):  # the contexts, written first
        if a:
            tiny.prefill_batch([torch.tensor(p[:a])], [slots_for(t, 0, a, BLOCK)], kv)
    tokens = [torch.tensor(p[a:]) for p, a in zip(prompts, starts, strict=True)]
    slots = [
        slots_for(t, a, len(p) - a, BLOCK) for p, t, a in zip(prompts, tables, starts, strict=True)
    ]
    logits = tiny.prefill_batch(tokens, slots, kv, starts=starts, block_tables=tables)
    for s, p in enumerate(prompts):
        dense = tiny.forward_dense(torch.tensor(p))[-1]
        torch.testing.assert_close(logits[s], dense, rtol=1e-4, atol=1e-4)


def test_context_attention_is_causal_sdpa_over_the_gathered_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, start, n = 4, 2, 8, 6, 5
    kv = torch.randn((8, 1, 2, BLOCK, hkv, d), generator=gen)
    table = torch.tensor([3, 6, 1])
    kv[0] = float("nan")  # never read: not in the table
    q = torch.randn((n, hq, d), generator=gen)
    out = context_attention(q, kv, 0, table, start)
    k = kv[table, 0, 0].reshape(-1, hkv, d)[: start + n].repeat_interleave(hq // hkv, 1)
    v = kv[table, 0, 1].reshape(-1, hkv, d)[: start + n].repeat_interleave(hq // hkv, 1)
    for i in range(n):  # query i sees positions 0 .. start+i
        scores = torch.einsum("hd,lhd->hl", q[i], k[: start + i + 1]) * d**-0.5
        ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[: start + i + 1])
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


def test_a_context_without_block_tables_is_refused(tiny: LlamaModel) -> None:
    kv = tiny.new_kv_cache(4, BLOCK)
    with pytest.raises(ValueError, match="block tables"):
        tiny.prefill_batch([torch.tensor([1, 2])], [torch.tensor([4, 5])], kv, starts=[4])
