"""The prefix cache through real daemons on CPU: greedy tokens with the cache on equal the cache
off and the single-process reference, token for token, for first requests, repeats, partial
overlaps, prompts that are a multiple of the block size and multi-turn chains; FINISH's
`cached_tokens` and STATUS's counters say what was reused; eviction under pool pressure with
concurrent identical prompts; an aborted request whose blocks another shares.

`cached_tokens` is predicted from the cache's rule (the longest cached run of full blocks, short
of the block holding the last prompt token), which the reference does not know about."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common import client
from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import Tokens
from tests.support.daemons import BLOCK, Pair
from tests.support.prefill import expected_hit, prompts

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, Pair]]:
    """A pair with the prefix cache (True) and one without (False)."""
    out: dict[bool, Pair] = {}
    try:
        for on in (True, False):
            path = Path(tmp_path_factory.mktemp("pc", numbered=True))
            os.chmod(path, 0o700)
            pair = out[on] = Pair(path)
            pair.start("decode")
            pair.start("prefill", "--prefix-cache" if on else "--no-prefix-cache")
        yield out
    finally:
        for pair in out.values():
            pair.kill_all()


def _run(pair: Pair, prompt: list[int], params: SamplingParams = GREEDY) -> client.Result:
    return asyncio.run(client.generate(pair.client_socket, prompt_tokens=prompt, sampling=params))


def test_cache_on_equals_cache_off_and_the_reference(pairs: dict[bool, Pair], tiny) -> None:  # type: ignore[no-untyped-def]
    model, _ = tiny
    a, b, c, d, e = prompts(5, [40, 25, 48, 16, 64], seed=21)
    sequence = [
        a,  # first request
        a,  # repeat
        a[:20] + b,  # partial overlap: one full block shared
        c,  # a multiple of the block size
        c,  # ... repeated: its last block is computed again
        d,
        d,  # one block, entirely cached: still computed (nothing reusable before its last token)
        e,
        e[:48],  # a prefix of a cached prompt, a multiple of the block size
    ]
    conv = prompts(1, [30], seed=5)[0]
    turns = prompts(4, [12, 9, 20, 5], seed=6)
    history: list[list[int]] = []
    queried = hit = 0
    for turn in range(len(turns) + len(sequence)):
        if turn < len(sequence):
            prompt = sequence[turn]
        else:  # multi-turn: the conversation so far, its answer and the next user turn
            conv = conv + turns[turn - len(sequence)]
            prompt = conv
        got = {on: _run(pair, prompt) for on, pair in pairs.items()}
        want = reference.generate(model, prompt, GREEDY, block_size=BLOCK)
        assert got[True].tokens == got[False].tokens == want, f"turn {turn}"
        assert got[False].finish is not None and got[False].finish.usage.cached_tokens == 0
        usage = got[True].finish.usage  # type: ignore[union-attr]
        assert usage.cached_tokens == expected_hit(history, prompt), f"turn {turn}"
        assert usage.prompt_tokens == len(prompt)
        queried += len(prompt)
        hit += usage.cached_tokens
        history.append(prompt)
        if turn >= len(sequence):
            conv = conv + got[True].tokens
    assert hit > 0
    st = asyncio.run(client.status(pairs[True].client_socket))
    assert st.prefix_cache["queried_tokens"] == queried
    assert st.prefix_cache["hit_tokens"] == hit
    assert st.prefix_cache["enabled"] == 1 and st.prefix_cache["cached_blocks"] > 0
    assert st.pool["free"] == st.pool["total"] and st.pool["cached"] > 0  # cached count as free
    off = asyncio.run(client.status(pairs[False].client_socket))
    assert off.prefix_cache["enabled"] == 0 and off.prefix_cache["hit_tokens"] == 0
    assert off.pool["cached"] == 0
    assert {r: p.stop_all() for r, p in pairs.items()} == {
        r: {"prefill": 0, "decode": 0} for r in pairs
    }


def test_eviction_under_pressure_with_concurrent_identical_prompts(pair_factory, tiny) -> None:  # type: ignore[no-untyped-def]
    """A 10-block prefill pool, rounds of identical and distinct 40-token prompts at once: blocks
    are evicted and reused, and every request still gets the reference's tokens."""
    model, _ = tiny
    pair = pair_factory
    pair.start("decode")
    pair.start("prefill", "--num-blocks", "10")
    shared = prompts(1, [40], seed=1)[0]

    async def rounds() -> list[tuple[list[int], list[int]]]:
        out = []
        for r in range(4):
            batch = [shared] * 3 + prompts(3, [40, 33, 47], seed=100 + r)
            got = await asyncio.gather(
                *(
                    client.generate(pair.client_socket, prompt_tokens=p, sampling=GREEDY)
                    for p in batch
                )
            )
            out += [(p, g.tokens) for p, g in zip(batch, got, strict=True)]
        return out

    results = asyncio.run(rounds())
    refs: dict[tuple[int, ...], list[int]] = {}
    for prompt, tokens in results:
        key = tuple(prompt)
        if key not in refs:
            refs[key] = reference.generate(model, prompt, GREEDY, block_size=BLOCK)
        assert tokens == refs[key]
    st = asyncio.run(client.status(pair.client_socket))
    assert st.prefix_cache["evictions"] > 0
    assert st.prefix_cache["hit_tokens"] > 0
    assert st.pool["free"] == st.pool["total"] and st.pool["owned"] == st.pool["leased"] == 0
    assert pair.stop_all() == {"prefill": 0, "decode": 0}


def test_a_request_aborted_while_another_shares_its_blocks(pair_factory, tiny) -> None:  # type: ignore[no-untyped-def]
    """Two long generations of one prompt; the first's client goes away after its first token.
    The second, sharing the first's cached blocks, still gets the reference's tokens."""
    model, _ = tiny
    pair = pair_factory
    pair.start("decode")
    pair.start("prefill")
    prompt = prompts(1, [50], seed=8)[0]
    long = SamplingParams(max_tokens=40, ignore_eos=True)

    async def go() -> client.Result:
        warm = await client.generate(pair.client_socket, prompt_tokens=prompt, sampling=GREEDY)
        assert warm.tokens  # the prompt's blocks are cached now
        aborted = client.stream(pair.client_socket, prompt_tokens=prompt, sampling=long)
        async with contextlib.aclosing(aborted) as msgs:
            first = await anext(msgs)
            assert isinstance(first, Tokens)
            other = asyncio.create_task(
                client.generate(pair.client_socket, prompt_tokens=prompt, sampling=long)
            )
            await asyncio.sleep(0.05)
        return await other  # the first request was aborted as its stream closed

    result = asyncio.run(go())
    assert result.tokens == reference.generate(model, prompt, long, block_size=BLOCK)
    assert result.finish is not None and result.finish.usage.cached_tokens == 48
    st = asyncio.run(client.status(pair.client_socket))
    assert st.pool["free"] == st.pool["total"] and st.inflight == 0
    assert pair.stop_all() == {"prefill": 0, "decode": 0}


def test_prompt_logprobs_get_no_cached_prefix_and_no_chunks(pair_factory, tiny) -> None:  # type: ignore[no-untyped-def]
    """A request that asks for prompt logprobs needs the logits at every prompt position: it takes
    no cached block (cached_tokens 0, a repeat scores the same) and is not chunked (chunks of 16
    here, a 50-token prompt); its blocks are cached after all, so a request without prompt
    logprobs still hits them. The hit rate counts only the requests that looked."""
    model, _ = tiny
    pair = pair_factory
    pair.start("decode")
    pair.start("prefill", "--max-prefill-tokens", "16")
    prompt = prompts(1, [50], seed=31)[0]
    scored = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    echo = SamplingParams(max_tokens=0, prompt_logprobs=2)  # only the prompt scored

    first = _run(pair, prompt, scored)
    lsm = torch.log_softmax(model.forward_dense(torch.tensor(prompt)), -1)
    want = [float(lsm[t - 1, prompt[t]]) for t in range(1, len(prompt))]
    assert [e.token for e in first.prompt_logprobs] == prompt[1:]  # every position
    assert [e.logprob for e in first.prompt_logprobs] == pytest.approx(want, abs=1e-4)
    assert first.tokens == reference.generate(model, prompt, scored, block_size=BLOCK)
    repeat = _run(pair, prompt, scored)
    plain = _run(pair, prompt)  # no prompt logprobs: the scored requests' blocks are cached
    scored_again = _run(pair, prompt, echo)
    for res in (first, repeat, scored_again):
        assert res.finish is not None and res.finish.usage.cached_tokens == 0
    for res in (repeat, scored_again):
        assert [(e.token, e.top) for e in res.prompt_logprobs] == [
            (e.token, e.top) for e in first.prompt_logprobs
        ]
        assert [e.logprob for e in res.prompt_logprobs] == pytest.approx(
            [e.logprob for e in first.prompt_logprobs], abs=1e-6
        )
    assert repeat.tokens == first.tokens and scored_again.tokens == []
    assert plain.finish is not None and plain.finish.usage.cached_tokens == 48
    assert plain.tokens == reference.generate(model, prompt, GREEDY, block_size=BLOCK)
    st = asyncio.run(client.status(pair.client_socket))
    assert st.prefix_cache["queried_tokens"] == len(prompt)  # the plain request alone looked
    assert st.prefix_cache["hit_tokens"] == 48
    assert st.pool["free"] == st.pool["total"]
    assert pair.stop_all() == {"prefill": 0, "decode": 0}
