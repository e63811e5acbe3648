"""The decode daemon's prefix cache through real daemons on CPU: it names the full prompt blocks
it pulled, keeps them after the sequence ends, and for a later prompt with the same prefix pulls
only the blocks it lacks: greedy tokens still equal the single-process reference, and its STATUS
counts the tokens it did not pull. The prefill runs without its own cache here, so every hit is
the decode's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common import client
from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from tests.support.daemons import BLOCK
from tests.support.prefill import expected_hit, prompts

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    return load_model(None)


def _run(sock: str, prompt: list[int]) -> list[int]:
    result = asyncio.run(client.generate(sock, prompt_tokens=prompt, sampling=GREEDY))
    return result.tokens


def test_the_decode_pulls_only_the_blocks_it_lacks(pair_factory, tiny) -> None:  # type: ignore[no-untyped-def]
    model, _ = tiny
    pair = pair_factory
    pair.start("decode")
    pair.start("prefill", "--no-prefix-cache")
    a, b = prompts(2, [45, 20], seed=31)
    conv = prompts(1, [18], seed=32)[0]
    history: list[list[int]] = []
    hit = queried = pulled = 0
    for prompt in [a, a, a[:33] + b, a[:32]]:
        assert _run(pair.client_socket, prompt) == reference.generate(
            model, prompt, GREEDY, block_size=BLOCK
        )
        hit += expected_hit(history, prompt)
        pulled += -(-len(prompt) // BLOCK) - expected_hit(history, prompt) // BLOCK
        queried += len(prompt)
        history.append(prompt)
    for turn in prompts(3, [9, 14, 21], seed=33):  # multi-turn: the conversation re-sent
        conv = conv + turn
        tokens = _run(pair.client_socket, conv)
        assert tokens == reference.generate(model, conv, GREEDY, block_size=BLOCK)
        hit += expected_hit(history, conv)
        pulled += -(-len(conv) // BLOCK) - expected_hit(history, conv) // BLOCK
        queried += len(conv)
        history.append(conv)
        conv = conv + tokens
    assert hit > 0
    decode = asyncio.run(client.status(pair.link_socket)).prefix_cache
    assert (decode["hit_tokens"], decode["queried_tokens"]) == (hit, queried)
    # only the blocks it lacked were pulled: a repeat moves one block, a new turn its own
    assert decode["pulled_blocks"] == pulled < -(-queried // BLOCK)
    assert decode["cached_blocks"] > 0
    prefill = asyncio.run(client.status(pair.client_socket)).prefix_cache
    assert prefill["enabled"] == 0 and prefill["hit_tokens"] == 0
    assert pair.stop_all() == {"prefill": 0, "decode": 0}


def test_decode_eviction_under_pressure_with_concurrent_identical_prompts(
    pair_factory, tiny
) -> None:  # type: ignore[no-untyped-def]
    """A 12-block decode pool, rounds of identical and distinct prompts at once: the decode
    evicts and reuses its cached blocks, and every request gets the reference's tokens."""
    model, _ = tiny
    pair = pair_factory
    pair.start("decode", "--num-blocks", "12")
    pair.start("prefill")
    shared = prompts(1, [40], seed=41)[0]

    async def rounds() -> list[tuple[list[int], list[int]]]:
        out = []
        for r in range(4):
            batch = [shared] * 2 + prompts(2, [40, 35], seed=200 + r)
            got = await asyncio.gather(
                *(
                    client.generate(pair.client_socket, prompt_tokens=p, sampling=GREEDY)
                    for p in batch
                )
            )
            out += [(p, g.tokens) for p, g in zip(batch, got, strict=True)]
        return out

    for prompt, tokens in asyncio.run(rounds()):
        assert tokens == reference.generate(model, prompt, GREEDY, block_size=BLOCK)
    st = asyncio.run(client.status(pair.link_socket))
    assert st.prefix_cache["evictions"] > 0 and st.prefix_cache["hit_tokens"] > 0
    assert st.pool["free"] == st.pool["total"] and st.pool["owned"] == 0
    assert pair.stop_all() == {"prefill": 0, "decode": 0}
