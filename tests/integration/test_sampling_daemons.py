"""Sampling features on real daemons: requests with different penalties, min_tokens,
stop_token_ids and logprobs decode in one batch, and each equals the single-process reference
(tokens) and the dense forward (logprobs), as if it ran alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common import client
from common.cuda import cuda_available
from common.model import reference
from common.model.loader import load_model
from common.protocol import MAX_LOGPROBS_PER_FRAME
from common.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    return load_model(None)[0]


def test_mixed_sampling_in_one_batch_equals_reference(pair, tiny) -> None:  # type: ignore[no-untyped-def]
    mixed_sampling_equals_reference(pair, tiny)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)")
def test_mixed_sampling_on_cuda_equals_reference(pair_factory) -> None:  # type: ignore[no-untyped-def]
    """The same on CUDA: the decode's steps replay CUDA graphs (penalized rows leave the graph's
    argmax for their own), the prefill runs the kernel forward with every position's logits."""
    args = ("--device", "cuda:0", "--dtype", "float32")
    pair_factory.start("decode", *args)
    pair_factory.start("prefill", *args)
    model, _ = load_model(None, device="cuda:0", dtype=torch.float32)
    mixed_sampling_equals_reference(pair_factory, model, tol=1e-3)
    prompt_logprobs_span_frames(pair_factory, model, tol=1e-3)
    assert pair_factory.stop_all() == {"prefill": 0, "decode": 0}


def mixed_sampling_equals_reference(pair, tiny, tol: float = 1e-4) -> None:  # type: ignore[no-untyped-def]
    prompts = [[256, *f"prompt number {i} says".encode()] for i in range(8)]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    stop = reference.generate(tiny, prompts[5], greedy)[4]
    params = [
        greedy,
        SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=0.2, logprobs=2),
        SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=-2, frequency_penalty=1),
        SamplingParams(max_tokens=12, temperature=0.9, seed=7, frequency_penalty=2, logprobs=0),
        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=20),
        SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,)),
        SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,), min_tokens=8),
        SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=2, min_tokens=3),
    ]

    async def run() -> list[client.Result]:
        return await asyncio.gather(
            *(
                client.generate(pair.client_socket, prompt_tokens=p, sampling=s)
                for p, s in zip(prompts, params, strict=True)
            )
        )

    results = asyncio.run(run())
    for i, (prompt, p, res) in enumerate(zip(prompts, params, results, strict=True)):
        assert res.tokens == reference.generate(tiny, prompt, p), f"request {i}"
        if p.logprobs is None:
            assert res.logprobs == []
            continue
        lsm = torch.log_softmax(tiny.forward_dense(torch.tensor(prompt + res.tokens)), -1)
        assert [e.token for e in res.logprobs] == res.tokens
        for t, e in enumerate(res.logprobs):
            row = lsm[len(prompt) - 1 + t]
            assert e.logprob == pytest.approx(float(row[e.token]), abs=tol)
            assert [i for i, _ in e.top] == torch.topk(row, p.logprobs).indices.tolist()
    assert results[5].finish.reason == "stop" and results[5].tokens[-1] == stop
    assert stop not in results[6].tokens[:8]
    assert results[0].tokens != results[1].tokens


def test_prompt_logprobs_of_a_long_prompt_span_frames(pair, tiny) -> None:  # type: ignore[no-untyped-def]
    prompt_logprobs_span_frames(pair, tiny)


def prompt_logprobs_span_frames(pair, tiny, tol: float = 1e-4) -> None:  # type: ignore[no-untyped-def]
    prompt = [256, *(bytes(range(32, 127)) * 6)]  # 571 tokens: two frames of prompt logprobs
    assert len(prompt) - 1 > MAX_LOGPROBS_PER_FRAME
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    res = asyncio.run(client.generate(pair.client_socket, prompt_tokens=prompt, sampling=params))
    assert res.tokens == [] and res.finish.reason == "length"
    assert res.finish.usage.completion_tokens == 0
    lsm = torch.log_softmax(tiny.forward_dense(torch.tensor(prompt)), -1)
    assert [e.token for e in res.prompt_logprobs] == prompt[1:]
    want = [float(lsm[t - 1, prompt[t]]) for t in range(1, len(prompt))]
    assert [e.logprob for e in res.prompt_logprobs] == pytest.approx(want, abs=tol)
    st = asyncio.run(client.status(pair.client_socket))
    assert st.pool["free"] == st.pool["total"]
