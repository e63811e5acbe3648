"""The single-process reference: greedy chains, stop rules, and batch invariance."""

from __future__ import annotations

import msgspec
import torch

from common.model import LlamaModel, SamplingParams, generate, generate_batch


def _prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lengths = [1, 2, 3, 5, 8, 13, 15, 16, 17, 21, 31, 32, 33, 40, 47, 64][:count]
    return [[256, *torch.randint(0, 256, (n - 1,), generator=g).tolist()] for n in lengths]


def test_batched_greedy_equals_each_sequence_decoded_alone(tiny: LlamaModel) -> None:
    prompts = _prompts(16)
    params = [SamplingParams(max_tokens=8 + (i % 5) * 4, ignore_eos=True) for i in range(16)]
    batched = generate_batch(tiny, prompts, params, block_size=8)
    alone = [generate(tiny, p, sp, block_size=8) for p, sp in zip(prompts, params, strict=True)]
    assert batched == alone
    assert [len(out) for out in batched] == [p.max_tokens for p in params]


def test_greedy_tokens_are_the_argmax_chain_of_the_dense_forward(tiny: LlamaModel) -> None:
    prompt = _prompts(7)[-1]
    out = generate(tiny, prompt, SamplingParams(max_tokens=20, ignore_eos=True), block_size=4)
    logits = tiny.forward_dense(torch.tensor(prompt + out[:-1]))
    assert out == logits[len(prompt) - 1 :].argmax(dim=-1).tolist()


def test_generation_stops_at_a_stop_token_and_keeps_it(tiny: LlamaModel) -> None:
    prompt = _prompts(4)[-1]
    free = generate(tiny, prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    stop = free[6]
    first = free.index(stop)
    stopped = generate(tiny, prompt, SamplingParams(max_tokens=30), stop_ids={stop})
    assert stopped == free[: first + 1]
    ignored = generate(
        tiny, prompt, SamplingParams(max_tokens=30, ignore_eos=True), stop_ids={stop}
    )
    assert ignored == free


def test_max_tokens_one_is_the_prefill_token(tiny: LlamaModel) -> None:
    prompt = _prompts(5)[-1]
    out = generate(tiny, prompt, SamplingParams(max_tokens=1))
    assert out == [int(tiny.forward_dense(torch.tensor(prompt))[-1].argmax())]


def test_seeded_sampling_is_reproducible_and_batch_invariant(tiny: LlamaModel) -> None:
    prompts = _prompts(6)
    params = SamplingParams(max_tokens=12, temperature=3.0, top_k=50, seed=1234, ignore_eos=True)
    first = generate_batch(tiny, prompts, params)
    assert first == generate_batch(tiny, prompts, params)
    assert first == [generate(tiny, p, params) for p in prompts]
    reseeded = generate_batch(tiny, prompts, msgspec.structs.replace(params, seed=99))
    assert reseeded != first
