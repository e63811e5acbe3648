"""The CUDA-graph decode runner and the kernel path on the GPU, against the torch path and HF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.cuda import cuda_available
from common.model import SamplingParams, load_model, reference, tiny_model
from tests.support.checkpoints import save_hf_llama
from tests.support.gpu_runner import runner_generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)"),
]
BF16_REL_TOL = 3e-2  # ‖bf16 logits − fp32 logits‖ / ‖fp32 logits‖, tiny model, kernels and graphs


PROMPTS = [[1, 2, 3], list(range(5, 45)), [7] * 17, list(range(100, 170)), [9]]


def test_graph_runner_greedy_equals_the_torch_reference_fp32() -> None:
    model = tiny_model(device="cuda", dtype=torch.float32)
    assert model.use_kernels
    got, _ = runner_generate(model, PROMPTS, 40)  # 5 rows: the bucket of 8 pads three
    model.use_kernels = False
    # the helper runs every row to max_tokens, EOS or not
    want = reference.generate_batch(model, PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert got == want


def test_graph_runner_bf16_logits_within_tolerance_of_fp32() -> None:
    _, logits32 = runner_generate(tiny_model(device="cuda", dtype=torch.float32), PROMPTS, 6)
    _, logits16 = runner_generate(tiny_model(device="cuda", dtype=torch.bfloat16), PROMPTS, 6)
    for a, b in zip(logits32, logits16, strict=True):
        assert float((a - b).norm() / a.norm()) < BF16_REL_TOL


def test_kernel_path_greedy_equals_transformers_on_the_gpu(tmp_path: Path) -> None:
    hf = save_hf_llama(tmp_path).to("cuda")
    model, _ = load_model(tmp_path, device="cuda", dtype=torch.float32, allow_byte_tokenizer=True)
    assert model.use_kernels
    prompt = [1, 17, 250, 3, 99, 42, 7, 128, 64, 5, 11, 290, 33]
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([prompt], device="cuda"),
            do_sample=False,
            max_new_tokens=24,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert reference.generate(model, prompt, SamplingParams(max_tokens=24), block_size=4) == hf_out
    got, _ = runner_generate(model, [prompt], 24, block_size=4)  # runs past EOS; HF stops there
    assert got[0][: len(hf_out)] == hf_out
