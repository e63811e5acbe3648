"""Loading a Hugging Face LlamaForCausalLM checkpoint: logits and greedy tokens equal transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import ModelError
from common.model import SamplingParams, generate, load_model
from common.model.tokenizer import ByteTokenizer
from tests.support.checkpoints import save_hf_llama

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-4  # max |ours - hf| <= REL_TOL * max |hf|, fp32

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize(
    ("tie", "rope"),
    [(False, None), (True, None), (False, LLAMA3_ROPE)],
    ids=["untied", "tied", "llama3"],
)
def test_logits_and_greedy_tokens_equal_transformers(tmp_path: Path, tie: bool, rope) -> None:
    hf = save_hf_llama(tmp_path, tie=tie, rope=rope)
    model, _ = load_model(tmp_path, allow_byte_tokenizer=True)
    assert model.config.tie_word_embeddings is tie
    assert (model.weights.lm_head is model.weights.embed) is tie
    prompt = [1, 17, 250, 3, 99, 42, 7, 128, 64, 5, 11, 290, 33]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    ours = model.forward_dense(torch.tensor(prompt))
    assert (ours - expected).abs().max() <= REL_TOL * expected.abs().max()

    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=24, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert generate(model, prompt, SamplingParams(max_tokens=24), block_size=4) == hf_out


def test_sharded_checkpoint_loads_the_same_model(tmp_path: Path) -> None:
    save_hf_llama(tmp_path / "one")
    save_hf_llama(tmp_path / "many", max_shard_size="40KB")
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 1
    one, _ = load_model(tmp_path / "one", allow_byte_tokenizer=True)
    many, _ = load_model(tmp_path / "many", allow_byte_tokenizer=True)
    prompt = torch.tensor([1, 5, 9, 200])
    torch.testing.assert_close(
        one.forward_dense(prompt), many.forward_dense(prompt), rtol=0, atol=0
    )
    assert one.fingerprint != many.fingerprint  # file layout is part of the identity


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save_hf_llama(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match=r"lacks tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_untied_checkpoint_without_lm_head_is_refused(tmp_path: Path) -> None:
    save_hf_llama(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match=r"lm_head\.weight"):
        load_model(tmp_path)


def test_corrupt_safetensors_is_a_model_error_naming_the_file(tmp_path: Path) -> None:
    save_hf_llama(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)  # header length far too large
    with pytest.raises(ModelError, match=r"cannot read .*model\.safetensors"):
        load_model(tmp_path, allow_byte_tokenizer=True)


def _edit_config(path: Path, **changes) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GemmaForCausalLM"]}, r"GemmaForCausalLM.*only LlamaForCausalLM"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
    ],
    ids=["architecture", "bias", "activation", "rope"],
)
def test_unsupported_checkpoint_is_refused_with_the_reason(
    tmp_path: Path, changes: dict, message: str
) -> None:
    save_hf_llama(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ModelError, match=message):
        load_model(tmp_path)


def test_directory_without_weights_or_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"no config\.json"):
        load_model(tmp_path)
    save_hf_llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"no \*\.safetensors"):
        load_model(tmp_path)


def test_checkpoint_without_tokenizer_json_is_refused_unless_bytes_are_allowed(
    tmp_path: Path,
) -> None:
    save_hf_llama(tmp_path)
    with pytest.raises(ModelError, match=r"no tokenizer\.json.*--allow-byte-tokenizer"):
        load_model(tmp_path)
    _, tokenizer = load_model(tmp_path, allow_byte_tokenizer=True)
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.eos_token_id == 2
