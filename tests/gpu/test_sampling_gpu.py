"""Prompt logprobs and penalties on the GPU's kernel path (gpu marker)."""

from __future__ import annotations

import pytest
import torch

from common.cuda import cuda_available
from common.model import SamplingParams, slots_for, tiny_model
from common.model.logits import TokenHistory, process
from common.model.prefill import prefill_many, split_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)"),
]
PROMPTS = [[1, 2, 3], list(range(5, 45)), [7] * 17, list(range(100, 170)), [9]]


def test_kernel_prefill_gives_every_position_only_where_asked() -> None:
    model = tiny_model(device="cuda", dtype=torch.float32)
    assert model.use_kernels
    kv = model.new_kv_cache(64, 16)
    mappings = [slots_for([2 * i, 2 * i + 1], 0, len(p), 16) for i, p in enumerate(PROMPTS)]
    tokens = [torch.tensor(p) for p in PROMPTS]
    every = [False, True, False, True, True]
    plain = prefill_many(model, tokens, mappings, kv)
    out = prefill_many(model, tokens, mappings, kv, every_position=every)
    last, full = split_rows(out, [len(p) for p in PROMPTS], every)
    torch.testing.assert_close(last, plain, rtol=0, atol=1e-4)
    for p, want, rows in zip(PROMPTS, every, full, strict=True):
        if not want:
            assert rows is None
            continue
        dense = model.forward_dense(torch.tensor(p))
        torch.testing.assert_close(rows, dense, rtol=0, atol=1e-3 * float(dense.abs().max()))


def test_penalties_on_the_device_equal_the_cpu() -> None:
    model = tiny_model(device="cuda", dtype=torch.float32)
    logits = model.forward_dense(torch.tensor(PROMPTS[3]))[-4:]
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(),
        SamplingParams(presence_penalty=1.0, frequency_penalty=-0.5, min_tokens=3),
        SamplingParams(repetition_penalty=0.5, presence_penalty=0.2),
    ]
    gen = [[3, 3, 9], [], [100, 101, 101], [7]]

    def hist(device: torch.device) -> list[TokenHistory]:
        return [TokenHistory.start(PROMPTS[3], g, 260, device) for g in gen]

    on_gpu = process(logits, params, hist(logits.device), [1, 1, 1, 1], {257})
    on_cpu = process(logits.cpu(), params, hist(torch.device("cpu")), [1, 1, 1, 1], {257})
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=0, atol=1e-6)
