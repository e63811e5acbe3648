"""Sliding-window attention: which layers slide (transformers' rule per architecture), the mask
every attention path applies (key j is seen from position i when 0 <= i - j < W), and the Triton
kernels against the torch functions they replace with a window.

The config and torch tests run everywhere (CI included); the kernel tests run on CUDA, or on the
CPU in Triton's interpreter (`TRITON_INTERPRET=1`), as tests/model/test_kernels.py does. The
architectures against transformers itself are in test_architectures.py.
"""

from __future__ import annotations

import itertools
import os

import msgspec
import pytest
import torch

from common.errors import ModelError
from common.model import LlamaConfig, SamplingParams, generate, slots_for
from common.model.kernels import kernels_usable
from common.model.loader import tiny_model
from common.model.paged import causal_mask, context_attention, paged_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS = pytest.mark.skipif(
    not kernels_usable(DEVICE) or os.environ.get("PDKV_KERNELS") == "0",
    reason="needs CUDA with triton, or triton with TRITON_INTERPRET=1",
)
TOL = 2e-5  # relative L2, fp32

HF_BASE = {
    "vocab_size": 300,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "hidden_act": "silu",
}


def _windows(arch: str, **fields) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    return LlamaConfig.from_hf({**HF_BASE, "architectures": [arch], **fields}).layer_windows


# ---- which layers slide ------------------------------------------------------------------------


def test_mistral_slides_every_layer_and_ignores_layer_types() -> None:
    assert _windows("MistralForCausalLM", sliding_window=8) == (8, 8, 8, 8)
    # MistralModel reads only sliding_window (transformers warns about layer_types and ignores it)
    types = ["full_attention"] * 4
    assert _windows("MistralForCausalLM", sliding_window=8, layer_types=types) == (8,) * 4
    assert _windows("MistralForCausalLM", sliding_window=None) == ()


def test_qwen_slides_from_max_window_layers_only_when_switched_on() -> None:
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        on = {"use_sliding_window": True, "sliding_window": 8}
        assert _windows(arch, **on, max_window_layers=1) == (0, 8, 8, 8)
        assert _windows(arch, **on, max_window_layers=3) == (0, 0, 0, 8)
        assert _windows(arch, **on) == ()  # transformers' default max_window_layers is 28
        assert _windows(arch, sliding_window=8, max_window_layers=0) == ()  # switch off
        types = ["sliding_attention", "full_attention"] * 2  # layer_types wins where written
        assert _windows(arch, **on, max_window_layers=3, layer_types=types) == (8, 0, 8, 0)


def test_llama_ignores_sliding_window_as_transformers_does() -> None:
    assert _windows("LlamaForCausalLM", sliding_window=8) == ()


def test_a_window_no_position_outgrows_is_plain_causal_attention() -> None:
    assert _windows("MistralForCausalLM", sliding_window=256) == ()
    assert _windows("MistralForCausalLM", sliding_window=255) == (255,) * 4


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (
            {"use_sliding_window": True, "sliding_window": 0},
            "sliding_window=0; a window holds at least 1",
        ),
        (
            {"use_sliding_window": True, "layer_types": ["full_attention"] * 3},
            "layer_types has 3 entries for 4 hidden layers",
        ),
        (
            {"use_sliding_window": True, "layer_types": ["chunked_attention"] * 4},
            "layer_types holds 'chunked_attention'",
        ),
    ],
    ids=["zero", "length", "type"],
)
def test_a_window_pdkv_cannot_follow_is_refused_in_one_line(fields: dict, says: str) -> None:
    with pytest.raises(ModelError, match=says) as refused:
        _windows("Qwen2ForCausalLM", **{"sliding_window": 8, **fields})
    assert "\n" not in str(refused.value)


def test_the_window_is_part_of_the_digest() -> None:
    full = LlamaConfig.from_hf({**HF_BASE, "architectures": ["MistralForCausalLM"]})
    slid = LlamaConfig.from_hf(
        {**HF_BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 8}
    )
    wider = msgspec.structs.replace(slid, layer_windows=(9,) * 4)
    assert len({full.digest(), slid.digest(), wider.digest()}) == 3
    assert msgspec.convert(slid.to_wire(), LlamaConfig) == slid
    with pytest.raises(ModelError, match="one window >= 0 per layer"):
        LlamaConfig.tiny(layer_windows=(8,))


# ---- the torch paths ---------------------------------------------------------------------------


def test_causal_mask_is_transformers_sliding_rule() -> None:
    mask = causal_mask(torch.arange(6), 6, 3)
    for i, j in itertools.product(range(6), range(6)):
        assert bool(mask[i, j]) == (0 <= i - j < 3)
    assert torch.equal(causal_mask(torch.arange(6), 6), torch.ones(6, 6).tril().bool())


def _dense(q, k, v, positions, window):  # type: ignore[no-untyped-def]
    """Attention of queries at `positions` over keys 0..L-1 by the formula, fp32, GQA."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    allowed = causal_mask(positions, k.shape[0], window)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _paged(length: int, block_size: int, hkv: int, d: int, gen):  # type: ignore[no-untyped-def]
    """K/V of `length` positions in a 1-layer pool through a shuffled block table (NaN in the
    blocks the table does not name) -> (kv, table, k, v)."""
    blocks = -(-length // block_size)
    kv = torch.full((blocks + 3, 1, 2, block_size, hkv, d), float("nan"))
    table = torch.randperm(blocks + 3, generator=gen)[:blocks]
    k = torch.randn((length, hkv, d), generator=gen)
    v = torch.randn((length, hkv, d), generator=gen)
    slots = slots_for(table, 0, length, block_size)
    kv[slots // block_size, 0, 0, slots % block_size] = k
    kv[slots // block_size, 0, 1, slots % block_size] = v
    return kv, table, k, v


@pytest.mark.parametrize("window", [1, 3, 8, 40])
def test_torch_paged_and_context_attention_mask_by_window(window: int) -> None:
    gen = torch.Generator().manual_seed(window)
    length, start = 30, 17
    kv, table, k, v = _paged(length, 4, 2, 8, gen)
    q = torch.randn((length, 6, 8), generator=gen)
    want = _dense(q, k, v, torch.arange(length), window)
    got = paged_attention(q[-1:], kv, 0, table[None], torch.tensor([length]), window=window)
    torch.testing.assert_close(got[0], want[-1], rtol=1e-5, atol=1e-5)
    got = context_attention(q[start:], kv, 0, table, start, window=window)
    torch.testing.assert_close(got, want[start:], rtol=1e-5, atol=1e-5)


def test_the_window_changes_what_the_model_generates() -> None:
    """The tiny model with a window of 4 on one layer: the dense, prefill+decode and
    cached-context paths agree with each other, and differ from the model without the window
    (so the window is really applied, and the tests above check something)."""
    slid = tiny_model(LlamaConfig.tiny(layer_windows=(0, 4)))
    full = tiny_model(LlamaConfig.tiny())
    slid.use_kernels = full.use_kernels = False
    prompt = list(range(60, 81))
    want = slid.forward_dense(torch.tensor(prompt))
    assert not torch.allclose(want, full.forward_dense(torch.tensor(prompt)), atol=1e-3)
    kv = slid.new_kv_cache(8, 4)
    table = [3, 0, 6, 1, 7, 2]
    slid.prefill_batch([torch.tensor(prompt[:9])], [slots_for(table, 0, 9, 4)], kv)
    rest = torch.tensor(prompt[9:])
    got = slid.prefill_batch(
        [rest], [slots_for(table, 9, len(rest), 4)], kv, [True], starts=[9], block_tables=[table]
    )
    torch.testing.assert_close(got, want[9:], rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    out = generate(slid, prompt, params, block_size=4)
    ids = prompt + out[:-1]
    assert out == slid.forward_dense(torch.tensor(ids)).argmax(-1)[len(prompt) - 1 :].tolist()


# ---- the kernels -------------------------------------------------------------------------------


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _pool(blocks: int, block_size: int, hkv: int, d: int, gen) -> torch.Tensor:
    """A 2-layer fp32 pool of random values, NaN in block 0 (the padding id)."""
    kv = torch.randn((blocks, 2, 2, block_size, hkv, d), generator=gen).to(DEVICE)
    kv[0] = float("nan")
    return kv


def _tables(ends: list[int], blocks: int, block_size: int, width: int, gen) -> torch.Tensor:
    """Distinct random blocks (never 0) covering each row's `ends` positions, padded with 0."""
    perm = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros((len(ends), width), dtype=torch.long)
    for row, end in enumerate(ends):
        k = -(-end // block_size)
        tables[row, :k] = torch.tensor(perm[:k], dtype=torch.long)
        perm = perm[k:]
    return tables.to(DEVICE)


@KERNELS
@pytest.mark.parametrize("window", [1, 8, 100, 300])
def test_paged_decode_kernel_masks_by_window(window: int) -> None:
    """Rows of lengths across blocks and the kernel's 256-key splits (which start at each row's
    window, one per 256 keys of the window), a padded row of length 0; NaN in every slot the
    window leaves out of a row would spoil it if read."""
    from common.model.kernels.attention import paged_decode_attention

    gen = torch.Generator().manual_seed(window)
    lens = [1, 7, 9, 255, 257, 600, 0]
    kv = _pool(200, 16, 2, 64, gen)
    tables = _tables(lens, 200, 16, 40, gen)
    for row, n in enumerate(lens):  # poison what the window excludes
        for p in range(max(n - window, 0)):
            kv[tables[row, p // 16], :, :, p % 16] = float("nan")
    q = torch.randn((len(lens), 8, 64), generator=gen).to(DEVICE)
    lens_t = torch.tensor(lens, device=DEVICE)
    out = paged_decode_attention(q, kv, 1, tables, lens_t, window=window)
    ref = paged_attention(q, kv.nan_to_num(), 1, tables, lens_t, window=window)
    assert not out.isnan().any()
    assert _rel(out[:-1], ref[:-1]) < TOL
    assert (out[-1] == 0).all()


@KERNELS
@pytest.mark.parametrize("window", [1, 5, 64, 70])
def test_varlen_prefill_kernel_masks_by_window(window: int) -> None:
    """Sequences longer than a 64-query tile, so a tile's first keys lie outside every row's
    window, some rows' windows begin past the tile's first key block."""
    from common.model.kernels.varlen_attention import varlen_causal_attention

    gen = torch.Generator().manual_seed(window)
    lengths = [150, 3, 70]
    n = sum(lengths)
    q = torch.randn((n, 8, 64), generator=gen).to(DEVICE)
    k = torch.randn((n, 2, 64), generator=gen).to(DEVICE)
    v = torch.randn((n, 2, 64), generator=gen).to(DEVICE)
    bounds = [0, *itertools.accumulate(lengths)]
    cu = torch.tensor(bounds, device=DEVICE)
    out = varlen_causal_attention(q, k, v, cu, max(lengths), window=window)
    assert not out.isnan().any()
    for a, b in itertools.pairwise(bounds):
        ref = _dense(q[a:b].cpu(), k[a:b].cpu(), v[a:b].cpu(), torch.arange(b - a), window)
        assert _rel(out[a:b], ref) < TOL


@KERNELS
@pytest.mark.parametrize(("splits", "split_keys"), [(None, 256), (1, 64), (5, 64)])
@pytest.mark.parametrize("window", [1, 9, 50, 200])
@pytest.mark.parametrize(("hq", "hkv"), [(6, 2), (8, 1)])
def test_context_kernel_masks_by_window(
    monkeypatch, splits, split_keys: int, window: int, hq: int, hkv: int
) -> None:
    """The paged-context prefill kernel and its merge with a window: cached contexts longer and
    shorter than the window, new runs longer than a query tile, forced split counts (a tile's
    keys start at its first query's window, so splits are counted from there), a length-0
    sequence and tokens past the last one (NaN q, never written)."""
    from common.model.kernels import context_attention as ca

    monkeypatch.setattr(ca, "SPLIT_KEYS", split_keys)
    gen = torch.Generator().manual_seed(window * 7 + hq + (splits or 0))
    starts = [0, 5, 300, 32, 7, 0]
    lengths = [70, 40, 33, 1, 0, 9]
    ends = [a + n for a, n in zip(starts, lengths, strict=True)]
    kv = _pool(96, 16, hkv, 64, gen)
    tables = _tables(ends, 96, 16, 24, gen)
    n = sum(lengths)
    q = torch.randn((n + 3, hq, 64), generator=gen).to(DEVICE)
    q[n:] = float("nan")
    bounds = [0, *itertools.accumulate(lengths)]
    cu = torch.tensor(bounds, device=DEVICE)
    st = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    out = ca._context_attention(
        q, kv, 1, cu, st, tables, max(lengths), splits=splits, window=window
    )
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        if b > a:
            ref = context_attention(q[a:b], kv, 1, tables[s], starts[s], window=window)
            assert not out[a:b].isnan().any()
            assert _rel(out[a:b], ref) < TOL


@KERNELS
def test_kernel_model_with_windows_equals_torch_model() -> None:
    """The tiny model with windows on both layers (4 and 11, crossing blocks of 4): the kernel
    path's prefill, cached-context prefill and decode give the torch path's tokens and logits."""
    model = tiny_model(LlamaConfig.tiny(layer_windows=(11, 4)), device=DEVICE)
    prompt = list(range(60, 81))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    results = {}
    for on in (False, True):
        model.use_kernels = on
        kv = model.new_kv_cache(8, 4)
        table = [3, 0, 6, 1, 7, 2]
        model.prefill_batch([torch.tensor(prompt[:12])], [slots_for(table, 0, 12, 4)], kv)
        rest = torch.tensor(prompt[12:])
        logits = model.prefill_batch(
            [rest], [slots_for(table, 12, 9, 4)], kv, [True], starts=[12], block_tables=[table]
        )
        results[on] = (logits, generate(model, prompt, params, block_size=4))
    assert _rel(results[True][0], results[False][0]) < 1e-5
    assert results[True][1] == results[False][1]
