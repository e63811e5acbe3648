"""Tokenizers (bytes, tokenizers adapter) and LlamaConfig parsing/identity."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from common.errors import ModelError
from common.model import ByteTokenizer, HFTokenizer, LlamaConfig, load_model


def test_byte_tokenizer_round_trips_utf8_and_drops_specials() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids[0] == tok.bos_token_id == 256
    assert all(0 <= i < 256 for i in ids[1:])
    assert tok.decode([*ids, tok.eos_token_id]) == "héllo ✓"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # truncated UTF-8 is replaced, not raised


def test_tiny_model_pairs_with_the_byte_tokenizer() -> None:
    model, tok = load_model(None)
    assert isinstance(tok, ByteTokenizer)
    assert model.config.vocab_size > max(tok.bos_token_id, tok.eos_token_id)
    assert model.kv_layout_args() == (2, 2, 16)
    assert model.fingerprint.startswith("tiny-seed0-")
    other, _ = load_model(None, seed=1)
    assert other.fingerprint != model.fingerprint


def _word_level_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )


def test_tokenizer_json_is_adapted(tmp_path: Path) -> None:
    _word_level_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path / "tokenizer.json", bos_token_id=None, eos_token_id=None)
    assert tok.encode("hello world") == [1, 3, 4]
    assert tok.decode([1, 3, 4, 2]) == "hello world"
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_malformed_tokenizer_json_is_a_model_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot read tokenizer"):
        HFTokenizer(tmp_path / "tokenizer.json", bos_token_id=None, eos_token_id=None)


HF_RAW = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def test_from_hf_reads_legacy_rope_scaling_and_eos_lists() -> None:
    c = LlamaConfig.from_hf(HF_RAW, name="Llama-3.2-1B")
    assert (c.head_dim, c.num_kv_heads, c.rope_type, c.rope_factor) == (64, 8, "llama3", 32.0)
    assert c.rope_theta == 500000.0
    assert c.eos_token_id == 128001
    assert c.stop_token_ids == {128001, 128008, 128009}
    assert msgspec.convert(c.to_wire(), LlamaConfig) == c


def test_from_hf_names_a_missing_field() -> None:
    raw = {k: v for k, v in HF_RAW.items() if k != "intermediate_size"}
    with pytest.raises(ModelError, match="intermediate_size"):
        LlamaConfig.from_hf(raw)


def test_digest_is_stable_and_tracks_every_field() -> None:
    assert LlamaConfig.tiny().digest() == LlamaConfig.tiny().digest()
    assert LlamaConfig.tiny().digest() != LlamaConfig.tiny(rope_theta=20000.0).digest()


def test_head_counts_must_group() -> None:
    with pytest.raises(ModelError, match="multiple of num_kv_heads"):
        LlamaConfig.tiny(num_heads=4, num_kv_heads=3)
