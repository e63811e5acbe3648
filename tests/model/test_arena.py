"""The weights arena: every tensor of a model in one allocation, at aligned offsets the config fixes."""

from __future__ import annotations

import itertools

import torch

from common.model.arena import ALIGN, WeightsLayout
from common.model.config import LlamaConfig
from common.model.loader import ModelSource, load_model, tiny_weights


def test_slots_are_aligned_and_apart_and_fill_the_arena() -> None:
    config = LlamaConfig.tiny(qkv_bias=True, qk_norm=True)
    layout = WeightsLayout.of(config, torch.bfloat16, separate_head=True)
    spans = sorted(
        (s.offset, s.offset + torch.Size(s.shape).numel() * 2) for s in layout.slots.values()
    )
    assert all(a % ALIGN == 0 for a, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    assert spans[-1][1] <= layout.nbytes < spans[-1][1] + ALIGN
    assert {"layers.1.qkv_bias", "layers.0.q_norm", "lm_head"} <= set(layout.slots)


def test_the_digest_names_dtype_head_and_shape() -> None:
    c = LlamaConfig.tiny()
    base = WeightsLayout.of(c, torch.float32, separate_head=True).digest()
    assert base == WeightsLayout.of(c, torch.float32, separate_head=True).digest()
    assert base != WeightsLayout.of(c, torch.float16, separate_head=True).digest()
    assert base != WeightsLayout.of(c, torch.float32, separate_head=False).digest()
    wider = LlamaConfig.tiny(intermediate_size=256)
    assert base != WeightsLayout.of(wider, torch.float32, separate_head=True).digest()


def test_the_model_is_views_of_one_arena_holding_the_seeded_weights() -> None:
    model, _ = load_model(None)
    w, want = model.weights, tiny_weights(LlamaConfig.tiny(), 0)
    base = w.embed.untyped_storage().data_ptr()
    for got, ref in ((w.embed, want.embed), (w.layers[1].qkv, want.layers[1].qkv)):
        assert got.untyped_storage().data_ptr() == base  # one allocation
        assert torch.equal(got, ref)
    source = ModelSource.find(None, device=torch.device("cpu"), dtype=None)
    assert w.embed.untyped_storage().nbytes() == source.layout.nbytes


def test_tied_embeddings_are_one_slot() -> None:
    config = LlamaConfig.tiny(tie_word_embeddings=True)
    layout = WeightsLayout.of(config, torch.float32, separate_head=False)
    arena = layout.allocate(torch.device("cpu"))
    layout.fill(arena, tiny_weights(config, 1))
    w = layout.weights(arena)
    assert "lm_head" not in layout.slots and w.lm_head is w.embed


def test_a_copy_of_a_checkpoint_fingerprints_alike_but_is_other_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The link compares fingerprints (config, file names and sizes); the weights are shared only
    between readers of the very same files."""
    from tests.support.checkpoints import write_checkpoint

    a = write_checkpoint(tmp_path / "a" / "ck")
    b = tmp_path / "b" / "ck"
    b.mkdir(parents=True)
    for f in a.iterdir():
        (b / f.name).write_bytes(f.read_bytes())
    cpu = torch.device("cpu")
    sa, sa2 = (ModelSource.find(a, device=cpu, dtype=None) for _ in range(2))
    sb = ModelSource.find(b, device=cpu, dtype=None)
    assert sa.fingerprint == sb.fingerprint
    assert sa.files_id == sa2.files_id != sb.files_id
