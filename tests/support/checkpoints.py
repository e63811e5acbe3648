"""Checkpoints written for the tests.

`write_checkpoint`: a small real checkpoint directory for the daemons: config.json,
model.safetensors and a tokenizer.json, written without transformers.

The weights are the tiny model's (`tiny_weights`, deterministic) under Hugging Face's tensor
names; the tokenizer is a word-level one over WORDS that puts BOS (`<s>`) first. What the tests
vary is the context length (`max_position_embeddings`) and the vocabulary sizes.

`save_hf_model`: a small random checkpoint of one architecture (llama, mistral, qwen2, qwen3) saved
by transformers itself, for what loads Hugging Face's checkpoints; `save_hf_llama` is its Llama.
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


# Each family's shape: odd on purpose (GQA 3:1 or 2:1; Qwen3's head_dim is not hidden/heads).
HF_FAMILIES: dict[str, dict] = {
    "llama": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=16),
    "qwen2": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2),
    "qwen3": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=32),
}
_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

_WINDOW_FIELDS = ("sliding_window", "use_sliding_window", "max_window_layers")


def save_hf_model(
    path: Path,
    family: str = "llama",
    *,
    tie: bool = False,
    rope: dict | None = None,
    config: dict | None = None,
    **kw,
) -> object:
    """A small random fp32 `family` model (a key of HF_FAMILIES) saved as safetensors under
    `path`; returns the model. Keywords that name a config field set it (e.g. sliding_window);
    `config` overrides any other field of the small shape (e.g. a full-width vocabulary); the
    rest go to save_pretrained. Skips the test where transformers is not installed."""
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls = (getattr(transformers, n) for n in _HF_CLASSES[family])
    # Mistral's default window (4096): none unless the test asks for one
    fields: dict = {"sliding_window": None} if family == "mistral" else {}
    fields |= {k: kw.pop(k) for k in list(kw) if k in _WINDOW_FIELDS}
    shape = dict(
        vocab_size=300, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256
    )
    hf_config = config_cls(
        tie_word_embeddings=tie,
        initializer_range=0.2,  # wide logits: greedy argmax must not hinge on 1e-7 differences
        bos_token_id=1,
        eos_token_id=2,
        **(shape | HF_FAMILIES[family] | fields | (config or {})),
        **({"rope_parameters": rope} if rope else {}),
    )
    torch.manual_seed(0)
    model = model_cls(hf_config).eval()
    if family in ("qwen2", "qwen3"):  # transformers starts biases at 0 and norms at 1: move them
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("proj.bias", "q_norm.weight", "k_norm.weight")):
                    p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, **kw)
    return model


def save_hf_llama(path: Path, *, tie: bool = False, rope: dict | None = None, **kw) -> object:
    """A small random GQA LlamaForCausalLM saved as safetensors under `path`; returns the model.
    Skips the test where transformers is not installed."""
    return save_hf_model(path, "llama", tie=tie, rope=rope, **kw)
