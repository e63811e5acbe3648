"""The CUDA-graph decode runner and the kernel path on the GPU, against the torch path and HF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.cuda import cuda_available
from common.model import SamplingParams, load_model, reference, slots_for, tiny_model
from common.model.prefill import prefill_many
from tests.support.checkpoints import save_hf_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)"),
]
BF16_REL_TOL = 3e-2  # ‖bf16 logits − fp32 logits‖ / ‖fp32 logits‖, tiny model, kernels and graphs


def _runner_generate(model, prompts, max_tokens, *, block_size=16, max_batch=8):
    """Greedy tokens of `prompts` through prefill_many and the graph runner (shrinking batch)."""
    from common.model.runner import DecodeRunner

    width = max(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    n = len(prompts)
    kv = model.new_kv_cache(width * n + 1, block_size)
    tables = (torch.arange(width * n).view(width, n).t() + 1).tolist()  # interleaved, never 0
    runner = DecodeRunner(model, kv, max_batch=max_batch, max_blocks=width)
    runner.capture()
    slots = [slots_for(tables[i], 0, len(p), block_size) for i, p in enumerate(prompts)]
    first = prefill_many(model, [torch.tensor(p) for p in prompts], slots, kv).argmax(-1)
    out = [[t] for t in first.tolist()]
    greedy = SamplingParams(max_tokens=max_tokens)
    active = list(range(n))
    logits_seen = []
    while active:
        pos = [len(prompts[i]) + len(out[i]) - 1 for i in active]
        step_slots = [
            int(slots_for(tables[i], p, 1, block_size)) for i, p in zip(active, pos, strict=True)
        ]
        args = ([out[i][-1] for i in active], pos, step_slots, [tables[i] for i in active])
        argmax, logits = runner.run(*args)
        toks = argmax.tolist()
        logits_seen.append(logits[0].clone())
        if len(out[active[0]]) == 2:  # `step` samples the same greedy tokens as `run`'s argmax
            again = runner.step(*args, [greedy] * len(active), [None] * len(active))
            assert again == toks
        for i, t in zip(active, toks, strict=True):
            out[i].append(t)
        active = [i for i in active if len(out[i]) < max_tokens]
    return out, logits_seen


PROMPTS = [[1, 2, 3], list(range(5, 45)), [7] * 17, list(range(100, 170)), [9]]


def test_graph_runner_greedy_equals_the_torch_reference_fp32() -> None:
    model = tiny_model(device="cuda", dtype=torch.float32)
    assert model.use_kernels
    got, _ = _runner_generate(model, PROMPTS, 40)  # 5 rows: the bucket of 8 pads three
    model.use_kernels = False
    # the helper runs every row to max_tokens, EOS or not
    want = reference.generate_batch(model, PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    assert got == want


def test_graph_runner_bf16_logits_within_tolerance_of_fp32() -> None:
    _, logits32 = _runner_generate(tiny_model(device="cuda", dtype=torch.float32), PROMPTS, 6)
    _, logits16 = _runner_generate(tiny_model(device="cuda", dtype=torch.bfloat16), PROMPTS, 6)
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
    got, _ = _runner_generate(model, [prompt], 24, block_size=4)  # runs past EOS; HF stops there
    assert got[0][: len(hf_out)] == hf_out
