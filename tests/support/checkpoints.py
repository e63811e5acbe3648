"""Checkpoints written for the tests.

`write_checkpoint`: a small real checkpoint directory for the daemons: config.json,
model.safetensors and a tokenizer.json, written without transformers.

The weights are the tiny model's (`tiny_weights`, deterministic) under Hugging Face's tensor
names; the tokenizer is a word-level one over WORDS that puts BOS (`<s>`) first. What the tests
vary is the context length (`max_position_embeddings`) and the vocabulary sizes.

`save_hf_llama`: a small random LlamaForCausalLM saved by transformers itself, for what loads
Hugging Face's checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
import torch
from safetensors.torch import save_file

from common.model import LlamaConfig
from common.model.loader import tiny_weights

SPECIALS = ["<unk>", "<s>", "</s>"]
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "and",
    "then",
    "sleeps",
    "in",
    "warm",
    "sun",
]


def write_checkpoint(
    path: Path, *, max_positions: int = 64, vocab_size: int = 32, tokenizer_words: int = 15
) -> Path:
    """A checkpoint in `path` (created) whose model has `vocab_size` ids and `max_positions`
    positions, with a tokenizer of the specials and the first `tokenizer_words` words (extra
    words are named w15, w16, ...)."""
    path.mkdir(parents=True, exist_ok=True)
    words = [*WORDS, *(f"w{i}" for i in range(len(WORDS), tokenizer_words))][:tokenizer_words]
    vocab = {t: i for i, t in enumerate([*SPECIALS, *words])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    config = LlamaConfig.tiny(
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    (path / "config.json").write_text(json.dumps(hf))
    save_file(_hf_tensors(config), str(path / "model.safetensors"))
    return path


def _hf_tensors(config: LlamaConfig) -> dict:
    w = tiny_weights(config, seed=3)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out = {
        "model.embed_tokens.weight": w.embed,
        "model.norm.weight": w.norm,
        "lm_head.weight": w.lm_head,
    }
    for n, layer in enumerate(w.layers):
        p = f"model.layers.{n}."
        wq, wk, wv = layer.qkv.split([q, kv, kv])
        gate, up = layer.gate_up.chunk(2)
        out |= {
            p + "input_layernorm.weight": layer.input_norm,
            p + "post_attention_layernorm.weight": layer.post_norm,
            p + "self_attn.q_proj.weight": wq,
            p + "self_attn.k_proj.weight": wk,
            p + "self_attn.v_proj.weight": wv,
            p + "self_attn.o_proj.weight": layer.o,
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.down,
        }
    return {k: v.contiguous() for k, v in out.items()}


def save_hf_llama(path: Path, *, tie: bool = False, rope: dict | None = None, **kw) -> object:
    """A small random GQA LlamaForCausalLM saved as safetensors under `path`; returns the model.
    Skips the test where transformers is not installed."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        initializer_range=0.2,  # wide logits: greedy argmax must not hinge on 1e-7 differences
        bos_token_id=1,
        eos_token_id=2,
        **({"rope_parameters": rope} if rope else {}),
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, **kw)
    return model
