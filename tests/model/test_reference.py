"""The single-process reference: greedy chains, stop rules, and batch invariance."""

from __future__ import annotations

import msgspec
import torch

from common.model import LlamaModel, SamplingParams, generate, generate_batch
from common.model.reference import compare


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


def _parted_at(tiny: LlamaModel, prompt: list[int], k: int, n: int) -> tuple[list[int], int, float]:
    """A greedy output of n tokens that takes the runner-up at token k and then follows the
    reference from it: (the output, the runner-up, its logit's margin below the top, relative)."""
    want = generate(tiny, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    logits = tiny.forward_dense(torch.tensor(prompt + want[:k]))[-1]
    top2 = torch.topk(logits, 2)
    runner_up = int(top2.indices[1])
    rel = float(top2.values[0] - top2.values[1]) / max(1.0, abs(float(top2.values[0])))
    taken = [*want[:k], runner_up]
    rest = SamplingParams(max_tokens=n - k - 1, ignore_eos=True)
    return taken + generate(tiny, prompt + taken, rest), runner_up, rel


def test_compare_lets_a_greedy_output_part_only_at_a_tie_within_the_margin(
    tiny: LlamaModel,
) -> None:
    prompt, params = _prompts(9)[-1], SamplingParams(max_tokens=12, ignore_eos=True)
    want = generate(tiny, prompt, params)
    got, runner_up, rel = _parted_at(tiny, prompt, 4, 12)
    assert got[:4] == want[:4] and got[4] == runner_up != want[4]
    ok, ties = compare(tiny, prompt, params, got, tie_margin=rel * 1.01)
    assert ok and [(t.at, t.want, t.got) for t in ties] == [(4, want[4], runner_up)]
    assert ties[0].margin > 0
    # the same parting with a margin below the runner-up's is a mismatch
    assert compare(tiny, prompt, params, got, tie_margin=rel * 0.99) == (False, [])
    # after the tie the output must follow the reference from the token taken
    worst = int(tiny.forward_dense(torch.tensor(prompt + got[:-1]))[-1].argmin())
    ok, ties = compare(tiny, prompt, params, [*got[:-1], worst], tie_margin=rel * 1.01)
    assert not ok and len(ties) == 1
    # a run cut short is a prefix; a whole run must have every token
    assert compare(tiny, prompt, params, got[:7], whole=False, tie_margin=rel * 1.01)[0]
    assert not compare(tiny, prompt, params, got[:7], tie_margin=rel * 1.01)[0]
    assert compare(tiny, prompt, params, want) == (True, [])


def test_compare_allows_no_tie_to_a_sampled_output(tiny: LlamaModel) -> None:
    prompt = _prompts(9)[-1]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True)
    want = generate(tiny, prompt, params)
    assert compare(tiny, prompt, params, want) == (True, [])
    other = [*want[:3], (want[3] + 1) % 256, *want[4:]]
    assert compare(tiny, prompt, params, other, tie_margin=1.0) == (False, [])


def test_compare_ends_an_output_at_a_stop_token_taken_at_a_tie(tiny: LlamaModel) -> None:
    """A stop token the output took at a tie must end it; and an output whose draw is not the
    raw logits' argmax (min_tokens) gets no tie at all."""
    prompt = _prompts(9)[-1]
    want = generate(tiny, prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    k, (got, runner_up, rel) = next(
        (k, parted)
        for k in range(1, 8)
        if (parted := _parted_at(tiny, prompt, k, 12))[1] not in want[:k]
    )
    stop_at_it = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(runner_up,))
    ok, ties = compare(tiny, prompt, stop_at_it, got[: k + 1], tie_margin=rel * 1.01)
    assert ok and [t.at for t in ties] == [k]
    ok, ties = compare(tiny, prompt, stop_at_it, got, tie_margin=rel * 1.01)  # went on past it
    assert not ok and [t.at for t in ties] == [k]
    at_least = SamplingParams(max_tokens=12, ignore_eos=True, min_tokens=1)
    assert compare(tiny, prompt, at_least, got, tie_margin=1.0) == (False, [])
