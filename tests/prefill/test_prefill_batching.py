"""Batched prefill through a real pair: concurrent prompts share forwards, and every request still
gets exactly what the single-process reference gives it (greedy and seeded sampling).

The batching is observed in the prefill's own log: one `prefill_batch` line per forward with the
number of requests and prompt tokens it ran. The burst is sent on one connection in one write, so
every GENERATE is in the daemon before the first forward returns (no timing involved).
"""

from __future__ import annotations

import asyncio

from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import Error, ErrorCode, Generate
from tests.support.daemons import BLOCK, Pair
from tests.support.prefill import burst, events, prompts

BATCHING = ("--max-prefill-tokens", "8192")  # batching on: the CPU default is 1


def _start(pair: Pair, *prefill_args: str) -> Pair:
    pair.start("decode")
    pair.start("prefill", *prefill_args)
    return pair


def _gen(i: int, prompt: list[int], params: SamplingParams) -> Generate:
    return Generate(sampling=params, prompt_tokens=prompt, request_id=f"b{i}", stream=False)


def test_a_burst_shares_forwards_and_equals_the_reference(pair_factory, tiny) -> None:  # type: ignore[no-untyped-def]
    """24 requests at once, greedy and seeded sampling mixed: fewer forwards than requests, and
    every request's tokens are the reference's (the same as one at a time)."""
    model, _ = tiny
    pair = _start(pair_factory, *BATCHING)
    n = 24
    texts = prompts(n, [1, 15, 16, 17, 33, 47, 64, 90])
    params = [
        SamplingParams(max_tokens=6 + i % 5, ignore_eos=True)
        if i % 2
        else SamplingParams(max_tokens=6, temperature=0.9, top_k=50, seed=100 + i, ignore_eos=True)
        for i in range(n)
    ]
    gens = [_gen(i, p, s) for i, (p, s) in enumerate(zip(texts, params, strict=True))]
    got = asyncio.run(burst(pair.client_socket, gens))
    for i, (p, s) in enumerate(zip(texts, params, strict=True)):
        assert got[f"b{i}"] == reference.generate(model, p, s, block_size=BLOCK), f"request {i}"
    batches = events(pair, "prefill_batch")
    assert sum(b["requests"] for b in batches) == n
    for i in (0, 3):  # seeded and greedy, alone through the same pair: the same tokens
        alone = asyncio.run(burst(pair.client_socket, [gens[i]]))
        assert alone[f"b{i}"] == got[f"b{i}"]
    assert len(batches) < n, f"one forward per request: {[b['requests'] for b in batches]}"
    assert max(b["requests"] for b in batches) > 1
    assert pair.stop_all() == {"prefill": 0, "decode": 0}


def test_a_batch_keeps_within_the_token_budget_and_a_long_prompt_runs_in_chunks(pair_factory, tiny):  # type: ignore[no-untyped-def]
    model, _ = tiny
    pair = _start(pair_factory, "--max-prefill-tokens", "64")
    lengths = [20, 30, 100, 25, 40, 10, 64, 33, 17, 12]
    texts = prompts(len(lengths), lengths, seed=5)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    got = asyncio.run(burst(pair.client_socket, [_gen(i, p, params) for i, p in enumerate(texts)]))
    for i, p in enumerate(texts):
        assert got[f"b{i}"] == reference.generate(model, p, params, block_size=BLOCK), f"req {i}"
    batches = events(pair, "prefill_batch")
    assert sum(b["requests"] for b in batches) == len(texts) + 1  # the 100 ran as 64 + 36
    assert all(b["tokens"] <= 64 for b in batches), batches  # a chunk never exceeds the budget
    assert sum("b2" in b["request_ids"] for b in batches) == 2
    assert max(b["requests"] for b in batches) > 1
    assert all(b["request_ids"] for b in batches)


def test_invalid_requests_in_a_burst_fail_alone(pair_factory, tiny) -> None:  # type: ignore[no-untyped-def]
    """Prompts that fail validation (token id past the vocab, empty, too long for the pool,
    sampling out of range) get BAD_REQUEST and never reach a batch; their neighbours are served."""
    model, _ = tiny
    pair = _start(pair_factory, *BATCHING)
    good = prompts(6, [9, 40, 16, 70, 3, 33], seed=11)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    gens = [_gen(i, p, params) for i, p in enumerate(good)]
    bad = {
        "x-vocab": Generate(sampling=params, prompt_tokens=[5, 100_000, 7], request_id="x-vocab"),
        "x-empty": Generate(sampling=params, prompt_tokens=[], request_id="x-empty"),
        "x-long": Generate(sampling=params, prompt_tokens=[1] * 9000, request_id="x-long"),
        "x-temp": Generate(
            sampling=SamplingParams(max_tokens=5, temperature=-1.0),
            prompt_tokens=[5, 6],
            request_id="x-temp",
        ),
    }
    mixed = [g for pair_ in zip(gens, [*bad.values(), None, None], strict=True) for g in pair_ if g]
    got = asyncio.run(burst(pair.client_socket, mixed))
    for rid in bad:
        assert isinstance(got[rid], Error) and got[rid].code == ErrorCode.BAD_REQUEST, got[rid]
    for i, p in enumerate(good):
        assert got[f"b{i}"] == reference.generate(model, p, params, block_size=BLOCK), f"req {i}"
    batches = events(pair, "prefill_batch")
    assert sum(b["requests"] for b in batches) == len(good)
    assert not any(rid in b["request_ids"] for b in batches for rid in bad)


def test_on_cpu_the_default_is_one_prompt_a_forward(pair_factory, tiny) -> None:  # type: ignore[no-untyped-def]
    """Without --max-prefill-tokens a CPU prefill runs each prompt in its own forward (a CPU
    forward costs about its tokens: sharing one only delays the first tokens)."""
    model, _ = tiny
    pair = _start(pair_factory)
    texts = prompts(8, [12, 30, 45, 9], seed=2)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    got = asyncio.run(burst(pair.client_socket, [_gen(i, p, params) for i, p in enumerate(texts)]))
    for i, p in enumerate(texts):
        assert got[f"b{i}"] == reference.generate(model, p, params, block_size=BLOCK), f"req {i}"
    batches = events(pair, "prefill_batch")
    assert [b["requests"] for b in batches] == [1] * len(texts)
