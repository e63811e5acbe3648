"""The Triton kernels against the torch path they replace, on random inputs and block tables.

These run on CUDA, or on the CPU in Triton's interpreter (`pip install triton`, then
`TRITON_INTERPRET=1 pytest tests/model/test_kernels.py`); elsewhere, CI included, they skip: the
interpreter needs the ~400 MB triton wheel and minutes of CPU, too much for CI (see docs).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from common.model import LlamaConfig, paged_attention, scatter_kv, slots_for
from common.model.kernels import kernels_usable
from common.model.llama import LlamaModel, rms_norm
from common.model.loader import tiny_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not kernels_usable(DEVICE) or os.environ.get("PDKV_KERNELS") == "0",
        reason="needs CUDA with triton, or triton with TRITON_INTERPRET=1",
    ),
]
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def _pool(blocks: int, block_size: int, hkv: int, d: int, dtype, gen) -> torch.Tensor:
    """A 2-layer pool of random values, NaN in block 0 (the padding id) and every unused slot."""
    kv = torch.randn((blocks, 2, 2, block_size, hkv, d), generator=gen).to(DEVICE, dtype)
    kv[0] = float("nan")
    return kv


def _tables(lengths: list[int], blocks: int, block_size: int, gen) -> torch.Tensor:
    """Each row owns distinct random blocks (never block 0); rows padded with 0."""
    need = [-(-n // block_size) for n in lengths]
    perm = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()
    width = max(max(need), 1)
    tables = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, k in enumerate(need):
        tables[row, :k] = torch.tensor(perm[:k], dtype=torch.long)
        perm = perm[k:]
    return tables.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (8, 2), (8, 1)])
def test_paged_decode_matches_torch(dtype, block_size: int, d: int, hq: int, hkv: int) -> None:
    from common.model.kernels.attention import paged_decode_attention

    gen = torch.Generator().manual_seed(block_size * d + hq * 7 + hkv)
    # batch mates of very different lengths, crossing block and 256-token split boundaries
    lengths = [1, block_size, block_size + 1, 300, 77]
    tables = _tables(lengths, 64, block_size, gen)
    kv = _pool(64, block_size, hkv, d, dtype, gen)
    lens = torch.tensor(lengths, device=DEVICE)
    q = torch.randn((len(lengths), hq, d), generator=gen).to(DEVICE, dtype)
    for layer in (0, 1):
        out = paged_decode_attention(q, kv, layer, tables, lens)
        ref = paged_attention(q, kv, layer, tables, lens)
        assert not out.isnan().any()
        assert _rel(out, ref) < TOL[dtype]
    # int32 tables and lengths (the runner's buffers may be either) give the same result
    out32 = paged_decode_attention(q, kv, 1, tables.int(), lens.int())
    assert torch.equal(out32, out)


def test_padded_rows_read_nothing_and_leave_real_rows_alone() -> None:
    from common.model.kernels.attention import paged_decode_attention

    gen = torch.Generator().manual_seed(5)
    kv = _pool(16, 16, 2, 64, torch.float32, gen)
    tables = _tables([40, 3], 16, 16, gen)
    q = torch.randn((2, 4, 64), generator=gen).to(DEVICE)
    alone = paged_decode_attention(q, kv, 0, tables, torch.tensor([40, 3], device=DEVICE))
    # the same rows plus two padded ones (length 0, table of block 0 = NaN) at the end
    pad_tables = torch.cat([tables, torch.zeros_like(tables)])
    pad_q = torch.cat([q, torch.full_like(q, float("nan"))])
    lens = torch.tensor([40, 3, 0, 0], device=DEVICE)
    out = paged_decode_attention(pad_q, kv, 0, pad_tables, lens)
    assert torch.equal(out[:2], alone)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 4, 64), (8, 2, 64), (8, 1, 128)])
def test_rope_and_store_match_torch(dtype, hq: int, hkv: int, d: int) -> None:
    from common.model.fastpath import rope_tables
    from common.model.kernels.fused import rope_and_store

    config = LlamaConfig.tiny(num_heads=hq, num_kv_heads=hkv, head_dim=d, hidden_size=hq * d)
    model = tiny_model(config=config, device=DEVICE, dtype=dtype)
    gen = torch.Generator().manual_seed(hq + d)
    n = 37
    positions = torch.randint(0, 5000, (n,), generator=gen).to(DEVICE)
    slots = torch.randperm(4 * 32, generator=gen)[:n].to(DEVICE)
    slots[3] = -1  # a padded row writes nothing
    qkv = torch.randn((n, (hq + 2 * hkv) * d), generator=gen).to(DEVICE, dtype)
    kv = _pool(4, 32, hkv, d, dtype, gen)
    ref_kv = kv.clone()

    cos, sin = model._rope(positions)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    ref_q = model._apply_rope(q.reshape(n, hq, d), cos, sin)
    ref_k = model._apply_rope(k.reshape(n, hkv, d), cos, sin)
    keep = slots >= 0
    scatter_kv(ref_kv, 1, slots[keep], ref_k[keep], v.reshape(n, hkv, d)[keep])

    got = qkv.clone()
    cos_t, sin_t = rope_tables(model)
    rope_and_store(got, positions, cos_t, sin_t, hq, hkv, kv, 1, slots)
    gq, gk, gv = got.split([hq * d, hkv * d, hkv * d], -1)
    assert _rel(gq.reshape(n, hq, d), ref_q) < TOL[dtype] / 4
    assert _rel(gk.reshape(n, hkv, d), ref_k) < TOL[dtype] / 4
    assert torch.equal(gv, v)  # v is only copied
    assert torch.allclose(kv.float(), ref_kv.float(), rtol=1e-2, atol=1e-2, equal_nan=True)
    assert torch.equal(kv.isnan(), ref_kv.isnan())  # slot -1 and unused slots untouched


def test_rope_never_reads_past_its_tables() -> None:
    """The tables are the first rows of larger ones whose next rows are NaN: a position at or
    past the end (or negative) would read them. It reads nothing and leaves its token as it
    was; the positions inside are rotated as before."""
    from common.model.fastpath import rope_tables
    from common.model.kernels.fused import rope_and_store

    model = tiny_model(config=LlamaConfig.tiny(max_position_embeddings=64), device=DEVICE)
    cos_t, sin_t = rope_tables(model)
    max_pos, half = cos_t.shape
    poison = torch.full((max_pos + 4096, half), float("nan"), device=DEVICE)
    cos_big, sin_big = poison.clone(), poison.clone()
    cos_big[:max_pos], sin_big[:max_pos] = cos_t, sin_t
    cos, sin = cos_big[:max_pos], sin_big[:max_pos]  # views: the NaN rows follow in memory
    c = model.config
    width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    positions = torch.tensor([0, 63, 64, 65, 4000, -1], device=DEVICE)
    qkv = torch.randn((6, width), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    got = qkv.clone()
    rope_and_store(got, positions, cos, sin, c.num_heads, c.num_kv_heads)
    assert torch.isfinite(got).all()
    assert torch.equal(got[2:], qkv[2:])  # outside the tables: not rotated
    inside = qkv[:2].clone()
    rope_and_store(inside, positions[:2], cos_t, sin_t, c.num_heads, c.num_kv_heads)
    assert torch.equal(got[:2], inside) and not torch.equal(got[1], qkv[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_silu_mul_match_torch(dtype) -> None:
    from common.model.kernels.fused import rms_norm as k_rms_norm
    from common.model.kernels.fused import silu_mul

    gen = torch.Generator().manual_seed(3)
    x = torch.randn((5, 320), generator=gen).to(DEVICE, dtype)
    res = torch.randn((5, 320), generator=gen).to(DEVICE, dtype)
    w = torch.rand(320, generator=gen).to(DEVICE, dtype)
    assert _rel(k_rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)) < TOL[dtype] / 4
    summed = res + x
    out = k_rms_norm(x, w, 1e-5, res)
    assert torch.equal(res, summed)  # the residual now holds the sum, rounded alike
    assert _rel(out, rms_norm(summed, w, 1e-5)) < TOL[dtype] / 4
    gu = torch.randn((5, 2 * 700), generator=gen).to(DEVICE, dtype)
    gate, up = gu.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert _rel(silu_mul(gu), ref) < TOL[dtype] / 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(2, 2, 64), (8, 2, 64), (8, 1, 128)])
def test_varlen_causal_matches_per_sequence_sdpa(dtype, hq: int, hkv: int, d: int) -> None:
    from common.model.kernels.varlen_attention import varlen_causal_attention

    gen = torch.Generator().manual_seed(hq * d)
    lengths = [1, 70, 5, 130]
    n = sum(lengths)
    qkv = torch.randn((n, (hq + 2 * hkv) * d), generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)  # strided, as in the model
    cu = torch.tensor([0, 1, 71, 76, n], device=DEVICE)
    out = varlen_causal_attention(q, k, v, cu, max(lengths))
    model = LlamaModel.__new__(LlamaModel)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        ref = model._causal_attention(q[a:b].float(), k[a:b].float(), v[a:b].float())
        assert _rel(out[a:b], ref) < TOL[dtype]


# the tiny model as it is, and with Qwen2's q/k/v bias and Qwen3's per-head q/k norm switched on
SWITCHES = [{}, {"qkv_bias": True, "qk_norm": True}]
SWITCH_IDS = ["llama", "bias-qknorm"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_head_norm_matches_torch(dtype) -> None:
    from common.model.kernels.fused import qk_head_norm

    gen = torch.Generator().manual_seed(4)
    hq, hkv, d = 6, 2, 32
    qkv = torch.randn((5, (hq + 2 * hkv) * d), generator=gen).to(DEVICE, dtype) * 3
    qw, kw = (torch.rand(d, generator=gen).to(DEVICE, dtype) + 0.5 for _ in range(2))
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    want_q = rms_norm(q.reshape(5, hq, d), qw, 1e-6).reshape(5, -1)
    want_k = rms_norm(k.reshape(5, hkv, d), kw, 1e-6).reshape(5, -1)
    v_before = v.clone()
    qk_head_norm(qkv, qw, kw, 1e-6, hq, hkv)
    assert _rel(q, want_q) < TOL[dtype] / 4
    assert _rel(k, want_k) < TOL[dtype] / 4
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("switches", SWITCHES, ids=SWITCH_IDS)
def test_kernel_forward_matches_torch_path(switches: dict) -> None:
    """The tiny model's decode and varlen prefill through the kernels equal the torch path's."""
    model = tiny_model(LlamaConfig.tiny(**switches), device=DEVICE, dtype=torch.float32)
    assert model.use_kernels
    gen = torch.Generator().manual_seed(11)
    lengths = (9, 40, 17)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
    tables = torch.tensor([[5, 0, 0], [1, 7, 3], [12, 2, 0]])
    slots = [slots_for(tables[i], 0, n, 16) for i, n in enumerate(lengths)]
    pos = torch.tensor(lengths)
    step_slots = torch.cat([slots_for(tables[i], n, 1, 16) for i, n in enumerate(lengths)])
    logits = {}
    for on in (False, True):
        model.use_kernels = on
        kv = model.new_kv_cache(16, 16)
        pre = model.prefill_batch(prompts, slots, kv)
        dec = model.decode_step(torch.tensor([1, 2, 3]), pos, step_slots, tables, pos + 1, kv)
        logits[on] = (pre, dec)
    model.use_kernels = True
    for ref, got in zip(logits[False], logits[True], strict=True):
        assert _rel(got, ref) < 1e-5
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(2, 2, 64), (8, 2, 64), (8, 1, 128)])
def test_varlen_context_matches_torch_context_attention(
    dtype, block_size: int, hq: int, hkv: int, d: int
) -> None:
    """The paged-context prefill kernel against paged.context_attention per sequence: contexts
    of 0, partial and whole blocks, new runs longer than a tile; NaN in unread slots."""
    from common.model.kernels.context_attention import varlen_context_attention
    from common.model.paged import context_attention

    gen = torch.Generator().manual_seed(hq * d + block_size)
    starts = [0, 37, block_size * 3, 5]
    lengths = [70, 1, 20, 90]
    kv = _pool(96, block_size, hkv, d, dtype, gen)
    tables = _tables([a + n for a, n in zip(starts, lengths, strict=True)], 96, block_size, gen)
    n = sum(lengths)
    q = torch.randn((n, hq, d), generator=gen).to(DEVICE, dtype)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(bounds, device=DEVICE)
    st = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    out = varlen_context_attention(q, kv, 1, cu, st, tables, max(lengths))
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        ref = context_attention(q[a:b].float(), kv.float(), 1, tables[s], starts[s])
        assert _rel(out[a:b], ref) < TOL[dtype]
        assert not out[a:b].isnan().any()


@pytest.mark.parametrize("switches", SWITCHES, ids=SWITCH_IDS)
def test_kernel_context_prefill_matches_torch_path(switches: dict) -> None:
    """The model's prefill over a cached context (and in chunks) through the kernels equals the
    torch path's, logits and the K/V it writes."""
    model = tiny_model(LlamaConfig.tiny(**switches), device=DEVICE, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (40, 23, 70)]
    starts = [32, 0, 17]
    tables = [[3, 9, 4], [1, 2], [5, 6, 7, 8, 10]]
    results = {}
    for on in (False, True):
        model.use_kernels = on
        kv = model.new_kv_cache(16, 16)
        for p, t, a in zip(prompts, tables, starts, strict=True):
            if a:
                model.prefill_batch([p[:a]], [slots_for(t, 0, a, 16)], kv)
        new = [p[a:] for p, a in zip(prompts, starts, strict=True)]
        slots = [slots_for(t, a, len(x), 16) for t, a, x in zip(tables, starts, new, strict=True)]
        logits = model.prefill_batch(new, slots, kv, starts=starts, block_tables=tables)
        results[on] = (logits, kv.clone())
    model.use_kernels = True
    assert _rel(results[True][0], results[False][0]) < 1e-5
    assert torch.equal(results[True][0].argmax(-1), results[False][0].argmax(-1))
    assert _rel(results[True][1], results[False][1]) < 1e-5


POISON = 12345.0  # what every buffer varlen_context_attention allocates starts as, in the tests


def _poisoned_empty(real_empty):  # type: ignore[no-untyped-def]
    """torch.empty that fills with POISON (ints: -1): a row the kernels leave unwritten keeps it,
    and a partial result the merge reads unwritten (m = l = acc = POISON) spoils its row."""

    def empty(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = real_empty(*args, **kwargs)
        return t.fill_(POISON if t.is_floating_point() else -1)

    return empty


def _context_case(  # type: ignore[no-untyped-def]
    hq, hkv, d, block_size, starts, lengths, width, pad_tokens, gen
):
    """Inputs of a paged-context batch (NaN in the pool's unused slots, in block 0 and in the q
    rows of `pad_tokens` tokens past the last sequence) -> (q, kv, cu, starts, tables)."""
    kv = _pool(128, block_size, hkv, d, torch.float32, gen)
    ends = [a + n for a, n in zip(starts, lengths, strict=True)]
    tables = torch.zeros((len(lengths), width), dtype=torch.long, device=DEVICE)
    part = _tables([e for e in ends if e], 128, block_size, gen)
    rows = [i for i, e in enumerate(ends) if e]
    tables[rows, : part.shape[1]] = part
    n = sum(lengths)
    q = torch.randn((n + pad_tokens, hq, d), generator=gen).to(DEVICE)
    q[n:] = float("nan")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    st = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    return q, kv, cu, st, tables


def _check_context(out, q, kv, cu, starts, tables) -> None:  # type: ignore[no-untyped-def]
    from common.model.paged import context_attention

    bounds = cu.tolist()
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        if b > a:
            ref = context_attention(q[a:b], kv, 1, tables[s], int(starts[s]))
            assert not out[a:b].isnan().any()
            assert _rel(out[a:b], ref) < TOL[torch.float32]
    assert (out[bounds[-1] :] == POISON).all()  # tokens past the last sequence: never written


@pytest.mark.parametrize(
    ("splits", "split_keys"), [(None, 64), (1, 64), (3, 64), (7, 64), (7, 256)]
)
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (6, 2), (8, 2), (8, 1)])
def test_varlen_context_splits_and_padding(
    monkeypatch, splits, split_keys: int, hq: int, hkv: int
) -> None:
    """The split kernel and its merge against paged.context_attention: GQA groups 1, 3 (padded
    to 4), 4 and 8; contexts of 0, a partial block, whole blocks and long ones (several splits,
    some splits empty for the short ones); runs longer than a query tile; a length-0 sequence
    mid-batch and one at the end (a graph's padding), and tokens past the last sequence (NaN q).
    SPLIT_KEYS (a tile's least keys per split, on the device) small: every tile but the shortest
    splits; the default 256: these contexts take one or two of the launch's seven splits, the
    one-split tiles writing their output directly while others go through the merge.
    Every buffer the function allocates starts poisoned, so an unwritten row or an unwritten
    partial read by the merge shows (see _poisoned_empty)."""
    from common.model.kernels import context_attention as ca

    monkeypatch.setattr(ca, "SPLIT_KEYS", split_keys)
    gen = torch.Generator().manual_seed(hq * 10 + hkv + (splits or 0))
    starts = [0, 5, 32, 300, 7, 450, 0]
    lengths = [70, 20, 33, 40, 0, 1, 0]
    q, kv, cu, st, tables = _context_case(hq, hkv, 64, 16, starts, lengths, 32, 5, gen)
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", _poisoned_empty(torch.empty))
        out = ca._context_attention(q, kv, 1, cu, st, tables, max(lengths), splits=splits)
    _check_context(out, q, kv, cu, st, tables)


@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (8, 2), (8, 1)])
def test_varlen_context_replays_with_other_starts(monkeypatch, hq: int, hkv: int) -> None:
    """What a prefill graph relies on: the same host shapes (max_seqlen, sequences, table width,
    the same buffers) with other device lengths and starts, longer and shorter, give the right
    result each time; the launch is one that splits the keys."""
    from common.model.kernels import context_attention as ca

    monkeypatch.setattr(ca, "SPLIT_KEYS", 64)  # these contexts' tiles use several splits
    gen = torch.Generator().manual_seed(hq + hkv)
    max_seqlen, width, bs = 48, 30, 16
    block_q, _ = ca.context_tiles(hq, hkv, 64, True, max_seqlen)
    tiles = -(-max_seqlen // block_q) * hkv * 3
    assert ca.context_splits(tiles, width * bs, ca.NUM_SMS) > 1
    q, kv, cu, st, tables = _context_case(
        hq, hkv, 64, bs, [400, 0, 100], [48, 30, 10], width, 0, gen
    )
    cases = [([400, 0, 100], [48, 30, 10]), ([3, 200, 0], [20, 48, 0]), ([0, 0, 0], [48, 1, 39])]
    for starts, lengths in cases:
        _, kv_new, cu_new, st_new, tables_new = _context_case(
            hq, hkv, 64, bs, starts, lengths, width, 0, gen
        )
        kv.copy_(kv_new), cu.copy_(cu_new), st.copy_(st_new), tables.copy_(tables_new)
        q.copy_(torch.randn(q.shape, generator=gen))  # 88 rows: a shorter case leaves some over
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", _poisoned_empty(torch.empty))
            out = ca.varlen_context_attention(q, kv, 1, cu, st, tables, max_seqlen)
        _check_context(out, q, kv, cu, st, tables)
