"""Cold start (issue 24, item 4), what runs on CPU: the warm-up's shape classes cover every
forward the prefill batcher can form (the real batcher's `_take` on random queues), and
the decode's graph buckets are the ones its runner picks from. The kernels themselves run at
start on CUDA only (tests/gpu/test_cold_start_gpu.py)."""

from __future__ import annotations

import asyncio
import random

import pytest

from common.model.sampling import SamplingParams
from common.model.warmup import (
    batch_buckets,
    bucket_of,
    context_groups,
    graph_token_buckets,
    prefill_groups,
    prefill_token_buckets,
)
from prefill_server.batcher import PrefillBatcher
from prefill_server.config import PrefillConfig

CASES = [  # (budget, longest prompt): CUDA's default budget, CPU's, one prompt longer than it
    (PrefillConfig().prefill_budget("cuda"), 2048),
    (PrefillConfig().prefill_budget("cpu"), 8192),
    (512, 4096),
    (1000, 300),
]


@pytest.mark.parametrize(("budget", "longest"), CASES)
def test_every_forward_the_batcher_forms_has_a_warmed_class(budget: int, longest: int) -> None:
    buckets = prefill_token_buckets(budget, longest)
    warmed = {(sum(g), len(g) > 1) for g in prefill_groups(buckets, budget, longest)}
    seen: set[tuple[int, bool]] = set()

    async def drain_queues() -> None:
        chunk = PrefillConfig().prefill_chunk()  # the daemon's: a longer prompt is chunked
        batcher = PrefillBatcher(None, None, budget, chunk)  # type: ignore[arg-type]  # no model
        rng = random.Random(budget)
        plain, scored = (
            SamplingParams(max_tokens=1),
            SamplingParams(max_tokens=1, prompt_logprobs=0),
        )
        for _ in range(300):
            for _ in range(rng.randrange(1, 40)):
                n = rng.choice([rng.randrange(1, 64), rng.randrange(1, longest + 1), longest])
                sampling = scored if rng.random() < 0.2 else plain  # prompt logprobs: whole
                batcher.submit("r", [1] * n, [], sampling, -1)
            while batch := batcher._take():
                tokens = sum(piece.end - piece.start for _, piece in batch)
                bucket = bucket_of(tokens, buckets)
                seen.add((bucket, len(batch) > 1))
                assert (bucket, len(batch) > 1) in warmed, (tokens, len(batch))

    asyncio.run(drain_queues())
    assert any(not varlen for _, varlen in seen)
    if budget > 1:
        assert any(varlen for _, varlen in seen)  # the varlen kernel's classes were met too


@pytest.mark.parametrize(("budget", "longest"), CASES)
def test_warm_up_groups_are_forwards_the_daemon_could_run(budget: int, longest: int) -> None:
    for group in prefill_groups(prefill_token_buckets(budget, longest), budget, longest):
        assert all(1 <= n <= longest for n in group)  # no prompt longer than accepted
        assert len(group) == 1 or sum(group) <= budget  # prompts share a forward within budget
    buckets = prefill_token_buckets(budget, longest)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max(budget, longest)
    assert all(n % 16 == 0 or n in (budget, longest) for n in buckets)


@pytest.mark.parametrize("block_size", [16, 32])
def test_context_warm_up_covers_both_table_stride_classes(block_size: int) -> None:
    """The paged-context kernel (a prefix cache hit, a chunk) is warmed alone and varlen, with
    block tables whose width is and is not a multiple of 16 (Triton specializes the stride)."""
    groups = context_groups(block_size)
    assert {(len(g) > 1, w % 16 == 0) for g, w in groups} == {
        (False, False),
        (False, True),
        (True, False),
        (True, True),
    }
    assert all(w >= 2 for _, w in groups)  # one cached block, then the new positions' block


@pytest.mark.parametrize("max_batch", [1, 3, 16, 64, 100, 256])
def test_decode_graph_buckets_hold_every_batch(max_batch: int) -> None:
    """The decode captures a graph per `batch_buckets(max_batch)` (DecodeRunner.capture) and
    replays the smallest that holds a batch (DecodeRunner.bucket_for): every batch size up to
    max_batch has one."""
    buckets = batch_buckets(max_batch)
    assert buckets[-1] == max_batch
    for n in range(1, max_batch + 1):
        assert next(b for b in buckets if b >= n) <= max_batch


@pytest.mark.parametrize("max_tokens", [1, 16, 100, 1024, 1025, 2000, 4096, 5000])
def test_prefill_graph_buckets_pad_a_long_forward_by_at_most_a_quarter(max_tokens: int) -> None:
    """PrefillGraphs captures a graph per `graph_token_buckets(max_tokens)` and replays the
    smallest that holds a forward: every forward of up to max_tokens tokens has one, multiples
    of 16 (Triton's specialization class), doubling up to 1,024 and, past it, at most a quarter
    above the forward's own tokens (a padded row costs a GPU forward what a real one does)."""
    buckets = graph_token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and all(b % 16 == 0 for b in buckets)
    assert buckets[-1] >= max_tokens and (len(buckets) == 1 or buckets[-2] < max_tokens)
    small = [b for b in buckets if b <= 1024]
    assert small == [16 * 2**i for i in range(len(small))]
    for n in range(1, max_tokens + 1):
        b = bucket_of(n, buckets)
        assert n <= b and (n <= 1024 or 4 * b <= 5 * n), (n, b)
    if max_tokens >= 2000:
        assert buckets[buckets.index(1024) + 1 : buckets.index(2048) + 1] == [
            1280,
            1536,
            1792,
            2048,
        ]
