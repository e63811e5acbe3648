"""Every architecture beside Llama (common/model/architectures.py) against transformers itself.

A random fp32 checkpoint of each family, saved by transformers (tests/support/checkpoints.py), is
the oracle: pdkv's logits equal transformers' within fp32 rounding and greedy tokens equal
`generate(do_sample=False)` token for token, through the torch path and (on CUDA, or on the CPU
with TRITON_INTERPRET=1) through the Triton kernels, a sliding window shorter than the prompt
included (Mistral's on every layer, Qwen's on the layers from max_window_layers on). What pdkv
does not compute is refused at load with the field named.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import ModelError
from common.model import LlamaConfig, SamplingParams, generate, load_model, slots_for
from common.model.kernels import kernels_usable
from tests.support.checkpoints import save_hf_model

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-4  # max |ours - hf| <= REL_TOL * max |hf|, fp32
PROMPT = [1, 17, 250, 3, 99, 42, 7, 128, 64, 5, 11]
FAMILIES = [
    ("qwen2", False),
    ("qwen2", True),
    ("qwen3", False),
    ("qwen3", True),
    ("mistral", False),
]
IDS = [f"{f}-{'tied' if t else 'untied'}" for f, t in FAMILIES]
KERNELS = pytest.mark.skipif(
    not kernels_usable(torch.device("cpu")) or os.environ.get("PDKV_KERNELS") == "0",
    reason="the CPU runs the kernels only in triton's interpreter: TRITON_INTERPRET=1",
)


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(("family", "tie"), FAMILIES, ids=IDS)
def test_torch_path_equals_transformers(tmp_path: Path, family: str, tie: bool) -> None:
    hf = save_hf_model(tmp_path, family, tie=tie)
    model, _ = load_model(tmp_path, allow_byte_tokenizer=True)
    model.use_kernels = False
    assert model.config.architecture == type(hf).__name__
    assert (model.weights.lm_head is model.weights.embed) is tie
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    ours = model.forward_dense(torch.tensor(PROMPT))
    assert (ours - expected).abs().max() <= REL_TOL * expected.abs().max()
    want = _hf_greedy(hf, PROMPT, 16)
    assert generate(model, PROMPT, SamplingParams(max_tokens=16), block_size=4) == want


@KERNELS
@pytest.mark.parametrize(
    ("family", "tie"), [("qwen2", True), ("qwen3", False), ("mistral", False)], ids=str
)
def test_kernel_path_equals_transformers(tmp_path: Path, family: str, tie: bool) -> None:
    hf = save_hf_model(tmp_path, family, tie=tie)
    model, _ = load_model(tmp_path, allow_byte_tokenizer=True)
    assert model.use_kernels
    prompt = PROMPT[:6]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1].float()
    kv = model.new_kv_cache(4, 4)
    ours = model.prefill(torch.tensor(prompt), torch.arange(len(prompt)), kv)
    assert (ours - expected).abs().max() <= REL_TOL * expected.abs().max()
    want = _hf_greedy(hf, prompt, 16)
    assert generate(model, prompt, SamplingParams(max_tokens=16), block_size=4) == want


def test_the_architecture_is_part_of_the_fingerprint(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "llama")
    raw = json.loads((tmp_path / "config.json").read_text())
    llama = LlamaConfig.from_hf(raw)
    mistral = LlamaConfig.from_hf({**raw, "architectures": ["MistralForCausalLM"]})
    assert (llama.qkv_bias, llama.qk_norm) == (mistral.qkv_bias, mistral.qk_norm)
    assert llama.digest() != mistral.digest()


@pytest.mark.parametrize(
    ("family", "drop"),
    [
        ("qwen2", "model.layers.1.self_attn.k_proj.bias"),
        ("qwen3", "model.layers.0.self_attn.q_norm.weight"),
    ],
    ids=["qwen2-bias", "qwen3-qnorm"],
)
def test_missing_architecture_tensor_is_named(tmp_path: Path, family: str, drop: str) -> None:
    save_hf_model(tmp_path, family)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[drop]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match="lacks tensors: " + re.escape(drop)):
        load_model(tmp_path, allow_byte_tokenizer=True)


# A window shorter than the prompt: Mistral slides every layer; Qwen from max_window_layers on
WINDOWED = [
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
]
WINDOW_PROMPT = [1, *range(40, 60)]  # 21 tokens; blocks of 4, so windows cross blocks


def _windowed_equals_transformers(model, hf, family: str) -> None:  # type: ignore[no-untyped-def]
    """Logits (the whole prompt at once, and its last 12 positions after the first 9 are
    cached), and 16 greedy tokens at block size 4, equal transformers'; without the window the
    logits would differ (so the window is applied, and matters)."""
    windows = model.config.layer_windows
    assert windows == ((8, 8) if family == "mistral" else (0, 8 if family == "qwen2" else 5))
    prompt = torch.tensor(WINDOW_PROMPT)
    with torch.no_grad():
        expected = hf(prompt[None]).logits[0].float()
    tol = REL_TOL * expected.abs().max()
    kv = model.new_kv_cache(8, 4)
    table = [5, 0, 3, 7, 1, 6]
    last = model.prefill(prompt, slots_for(table, 0, len(prompt), 4), kv)
    assert (last - expected[-1]).abs().max() <= tol
    model.prefill_batch([prompt[:9]], [slots_for(table, 0, 9, 4)], kv)
    cached = model.prefill_batch(
        [prompt[9:]], [slots_for(table, 9, 12, 4)], kv, [True], starts=[9], block_tables=[table]
    )
    assert (cached - expected[9:]).abs().max() <= tol
    want = _hf_greedy(hf, WINDOW_PROMPT, 16)
    assert generate(model, WINDOW_PROMPT, SamplingParams(max_tokens=16), block_size=4) == want
    model.config = msgspec.structs.replace(model.config, layer_windows=())
    try:
        assert (model.forward_dense(prompt) - expected).abs().max() > 100 * tol
    finally:
        model.config = msgspec.structs.replace(model.config, layer_windows=windows)


@pytest.mark.parametrize(("family", "config"), WINDOWED, ids=[f for f, _ in WINDOWED])
def test_sliding_window_torch_path_equals_transformers(
    tmp_path: Path, family: str, config: dict
) -> None:
    hf = save_hf_model(tmp_path, family, **config)
    model, _ = load_model(tmp_path, allow_byte_tokenizer=True)
    model.use_kernels = False
    with torch.no_grad():
        expected = hf(torch.tensor([WINDOW_PROMPT])).logits[0].float()
    ours = model.forward_dense(torch.tensor(WINDOW_PROMPT))
    assert (ours - expected).abs().max() <= REL_TOL * expected.abs().max()
    _windowed_equals_transformers(model, hf, family)


@KERNELS
@pytest.mark.parametrize(("family", "config"), WINDOWED, ids=[f for f, _ in WINDOWED])
def test_sliding_window_kernel_path_equals_transformers(
    tmp_path: Path, family: str, config: dict
) -> None:
    hf = save_hf_model(tmp_path, family, **config)
    model, _ = load_model(tmp_path, allow_byte_tokenizer=True)
    assert model.use_kernels
    _windowed_equals_transformers(model, hf, family)


@pytest.mark.parametrize(
    ("family", "config"),
    [
        ("mistral", {"sliding_window": 256}),
        # Qwen: layers below max_window_layers (default 28) never slide, so none of these two does
        ("qwen3", {"use_sliding_window": True, "sliding_window": 32}),
    ],
    ids=["window-covers-all", "no-layer-slides"],
)
def test_a_window_no_position_reaches_loads(tmp_path: Path, family: str, config: dict) -> None:
    hf = save_hf_model(tmp_path, family, **config)
    model, _ = load_model(tmp_path, allow_byte_tokenizer=True)
    model.use_kernels = False
    assert model.config.layer_windows == ()  # plain causal attention: the unmasked kernels
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    ours = model.forward_dense(torch.tensor(PROMPT))
    assert (ours - expected).abs().max() <= REL_TOL * expected.abs().max()


def test_qwen3_attention_bias_is_refused(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "qwen3")
    raw = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ModelError, match=r"attention_bias=true .*Qwen3ForCausalLM"):
        LlamaConfig.from_hf({**raw, "attention_bias": True})


# Qwen2.5's config.json as older transformers wrote it: no layer_types, so the switch decides
QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "use_sliding_window": False,
    "max_window_layers": 2,
}


@pytest.mark.parametrize(
    ("changes", "windows"),
    [
        ({}, ()),
        ({"use_sliding_window": True}, (0, 0, 4096, 4096)),
        ({"use_sliding_window": True, "max_window_layers": 4}, ()),
    ],
    ids=["switch-off", "layers-2-3-slide", "no-layer-slides"],
)
def test_qwen_window_without_layer_types_follows_the_switch(changes: dict, windows: tuple) -> None:
    config = LlamaConfig.from_hf({**QWEN25, **changes})
    assert (config.qkv_bias, config.qk_norm) == (True, False)
    assert config.layer_windows == windows
