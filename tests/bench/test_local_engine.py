"""bench/local_engine.py, the single-process side of bench/serve.py: the tiny model's greedy
output must equal the reference generator's, whatever the arrivals and the pool size do to the
batches, and every block must come back."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from local_engine import LocalEngine

from common.model import generate_batch, tiny_model
from common.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    # one torch thread, as the daemons and bench/serve.py run the tiny model: on a busy 2-core
    # machine two spinning OpenMP threads make each step ~10x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model()
    torch.set_num_threads(threads)


async def _run(engine: LocalEngine, prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        await asyncio.sleep(0.002 * i)  # staggered: later requests join a running batch
        out: list[int] = []
        async for tokens in engine.stream(prompts[i], SamplingParams(lens[i], ignore_eos=True)):
            out += tokens
        return out

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


@pytest.mark.parametrize("num_blocks", [64, 8])  # 8: requests wait for blocks to come back
def test_greedy_output_equals_the_reference(model, num_blocks: int) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(num_blocks)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 20))] for _ in range(10)]
    lens = [rng.randint(1, 9) for _ in prompts]
    engine = LocalEngine(model, num_blocks=num_blocks, block_size=4, max_batch=3)
    with engine:
        got = asyncio.run(_run(engine, prompts, lens))
    params = [SamplingParams(n, ignore_eos=True) for n in lens]
    assert got == generate_batch(model, prompts, params, block_size=4)
    assert engine.allocator.num_free == num_blocks


def test_a_request_that_cannot_fit_fails_alone(model) -> None:  # type: ignore[no-untyped-def]
    async def go(engine: LocalEngine) -> tuple[str, list[int]]:
        with pytest.raises(RuntimeError) as err:
            async for _ in engine.stream([1] * 30, SamplingParams(10, ignore_eos=True)):
                pass
        ok = [
            t async for ts in engine.stream([1, 2], SamplingParams(3, ignore_eos=True)) for t in ts
        ]
        return str(err.value), ok

    with LocalEngine(model, num_blocks=4, block_size=4) as engine:
        message, ok = asyncio.run(go(engine))
    assert "does not fit" in message and "4 blocks" in message
    assert (
        ok == generate_batch(model, [[1, 2]], SamplingParams(3, ignore_eos=True), block_size=4)[0]
    )
