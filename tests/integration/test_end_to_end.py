"""The correctness anchor on real processes: disaggregated greedy output equals the reference."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from common import client
from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model(None)


def _prompts(n: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    # mixed lengths, many crossing block boundaries (15, 16, 17, 31, 33, ...)
    lengths = [1, 15, 16, 17, 31, 32, 33, 47, 64, 65, 90, 5]
    return [
        [rng.randrange(256) for _ in range(lengths[i % len(lengths)] + i // 12)] for i in range(n)
    ]


def test_64_concurrent_requests_equal_reference(pair, tiny):
    model, _ = tiny
    prompts = _prompts(64)
    params = [SamplingParams(max_tokens=8 + i % 13, ignore_eos=True) for i in range(64)]

    async def run_all():
        return await asyncio.gather(
            *(
                client.generate(pair.client_socket, prompt_tokens=p, sampling=s, request_id=f"r{i}")
                for i, (p, s) in enumerate(zip(prompts, params, strict=True))
            )
        )

    results = asyncio.run(run_all())
    for i, (res, p, s) in enumerate(zip(results, prompts, params, strict=True)):
        expected = reference.generate(model, p, s, block_size=BLOCK)
        assert res.tokens == expected, f"request {i} (prompt {len(p)} tokens) differs"
        assert res.finish is not None and res.finish.reason == "length"
        assert res.finish.usage.completion_tokens == s.max_tokens
    st = asyncio.run(client.status(pair.client_socket))
    assert st.pool["free"] == st.pool["total"], "prefill leaked blocks"
    st = asyncio.run(client.status(pair.link_socket))
    assert st.pool["free"] == st.pool["total"], "decode leaked blocks"
    assert pair.stop_all() == {"prefill": 0, "decode": 0}


def test_overlapped_decode_steps_equal_reference(pair_factory, tiny):
    """--overlap-steps on (auto turns it on for CUDA only): greedy requests of many lengths, some
    stopped by a stop token, and seeded sampled ones that make the batch leave the overlap now
    and then, through real daemons: every stream is the reference's and no block stays owned."""
    stopped = _mixed_requests_equal_reference(pair_factory, tiny, "--overlap-steps", "on")
    assert stopped["overlapped"] > 0, "no step ran ahead"


def test_prefill_first_holds_equal_reference(pair_factory, tiny):
    """--prefill-first-ms: the decode holds its steps while the prefill computes prompts it
    handed off early; the same mixed requests, arriving together, still give the reference's
    streams, free every block, and the decode did hold (none of its holds is a no-op)."""
    args = ("--overlap-steps", "on", "--prefill-first-ms", "200")
    stopped = _mixed_requests_equal_reference(pair_factory, tiny, *args)
    assert stopped["prefill_first_holds"] > 0, stopped
    assert stopped["prefill_first_held_s"] > 0, stopped


def _mixed_requests_equal_reference(pair_factory, tiny, *decode_args: str) -> dict:  # type: ignore[no-untyped-def]
    """24 mixed requests at once through a pair whose decode takes `decode_args`: each stream
    equals the reference, no block stays owned, both exit 0. -> the decode's decode_loop_stopped
    log line."""
    model, _ = tiny
    pair_factory.start("decode", *decode_args)
    pair_factory.start("prefill")
    prompts = _prompts(24, seed=3)
    params = []
    for i, p in enumerate(prompts):
        if i in (5, 17):  # short: the batch is all greedy, and runs ahead, most of the time
            sp = SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
        elif i % 4 == 1:  # stop on the 4th token the reference gives
            ref = reference.generate(model, p, SamplingParams(max_tokens=12, ignore_eos=True))
            sp = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(ref[3],))
        else:
            sp = SamplingParams(max_tokens=4 + i % 9, ignore_eos=True)
        params.append(sp)

    async def run_all():
        return await asyncio.gather(
            *(
                client.generate(
                    pair_factory.client_socket, prompt_tokens=p, sampling=s, request_id=f"o{i}"
                )
                for i, (p, s) in enumerate(zip(prompts, params, strict=True))
            )
        )

    results = asyncio.run(run_all())
    for i, (res, p, s) in enumerate(zip(results, prompts, params, strict=True)):
        assert res.tokens == reference.generate(model, p, s, block_size=BLOCK), f"request {i}"
    for sock in (pair_factory.client_socket, pair_factory.link_socket):
        st = asyncio.run(client.status(sock))
        assert st.pool["free"] == st.pool["total"], f"{st.role} leaked blocks: {st.pool}"
    decode = pair_factory.daemons["decode"]
    assert pair_factory.stop_all() == {"prefill": 0, "decode": 0}
    stopped = [
        json.loads(line) for line in decode.log_text().splitlines() if "decode_loop_stopped" in line
    ]
    assert stopped, "the decode did not log its loop's end"
    return stopped[0]


def test_text_prompt_streams_and_seeded_sampling_matches_reference(pair, tiny):
    model, tok = tiny
    params = SamplingParams(
        max_tokens=12, temperature=0.8, top_k=40, top_p=0.9, seed=1234, ignore_eos=True
    )
    res = asyncio.run(
        client.generate(pair.client_socket, prompt="Hello, paged world", sampling=params)
    )
    expected = reference.generate(model, tok.encode("Hello, paged world"), params, block_size=BLOCK)
    assert res.tokens == expected
    assert res.text == tok.decode(expected)
    t = res.finish.timings
    assert t["ttft_ms"] > 0 and t["handoff_us"] > 0 and t["total_ms"] >= t["ttft_ms"]
    # the prefill's share of the TTFT: admission, queue and forward, each inside it
    parts = [t["prefill_admit_us"], t["prefill_queue_us"], t["prefill_forward_us"]]
    assert min(parts) >= 0 and t["prefill_forward_us"] > 0
    assert sum(parts) <= t["ttft_ms"] * 1000 + 1
    # and around it: the GENERATE's read until its admission, the first token until it left
    assert t["prefill_read_us"] >= 0 and t["first_out_us"] >= 0
    assert t["total_ms"] * 1000 >= t["ttft_ms"] * 1000 + t["first_out_us"] - 1


def test_stream_flag_decides_where_the_text_travels(pair, tiny):
    """stream=true: TOKENS carry the text as it grows; false: ids only, the whole text in FINISH.
    Token ids and the text are the same either way."""
    model, tok = tiny
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompt = "Where does the text go?"

    async def frames(deltas: bool) -> list:
        return [
            m
            async for m in client.stream(
                pair.client_socket, prompt=prompt, sampling=params, text_deltas=deltas
            )
        ]

    expected = reference.generate(model, tok.encode(prompt), params, block_size=BLOCK)
    for deltas in (True, False):
        got = asyncio.run(frames(deltas))
        tokens = [t for m in got if isinstance(m, client.Tokens) for t in m.tokens]
        assert tokens == expected, deltas
        assert "".join(m.text for m in got) == tok.decode(expected), deltas
        token_text = "".join(m.text for m in got if isinstance(m, client.Tokens))
        if deltas:
            assert token_text, "streamed TOKENS carried no text"
        else:
            assert token_text == "" and got[-1].text == tok.decode(expected)


def test_max_tokens_one_finishes_without_handoff(pair, tiny):
    model, _ = tiny
    res = asyncio.run(
        client.generate(
            pair.client_socket, prompt_tokens=[1, 2, 3], sampling=SamplingParams(max_tokens=1)
        )
    )
    assert res.tokens == reference.generate(model, [1, 2, 3], SamplingParams(max_tokens=1))
    assert res.finish.reason == "length"
    st = asyncio.run(client.status(pair.link_socket))
    assert st.links[0]["handoffs"] == 0


def test_bad_requests_get_clear_errors(pair_factory):
    pair_factory.start("decode")
    pair_factory.start("prefill", "--max-prompt-tokens", "64")
    pair = pair_factory

    async def expect(code: str, **kw):
        with pytest.raises(client.RequestFailed) as info:
            await client.generate(pair.client_socket, **kw)
        assert info.value.code == code, str(info.value)
        return str(info.value)

    async def run():
        msg = await expect("BAD_REQUEST", prompt_tokens=[], sampling=SamplingParams())
        assert "empty" in msg
        # an empty text prompt too, though the tokenizer would turn it into BOS alone
        msg = await expect("BAD_REQUEST", prompt="", sampling=SamplingParams())
        assert "empty" in msg
        msg = await expect("BAD_REQUEST", prompt_tokens=[1] * 65, sampling=SamplingParams())
        assert "65 tokens, more than the 64 allowed" in msg and "--max-prompt-tokens" in msg
        at_limit = await client.generate(
            pair.client_socket, prompt_tokens=[1] * 64, sampling=SamplingParams(max_tokens=2)
        )
        assert len(at_limit.tokens) == 2
        await expect("BAD_REQUEST", prompt_tokens=[999999], sampling=SamplingParams())
        await expect("BAD_REQUEST", prompt="x", prompt_tokens=[1], sampling=SamplingParams())
        msg = await expect("BAD_REQUEST", prompt="x", sampling=SamplingParams(max_tokens=0))
        assert "max_tokens" in msg
        # the daemon still serves afterwards
        ok = await client.generate(
            pair.client_socket, prompt="ok", sampling=SamplingParams(max_tokens=3)
        )
        assert len(ok.tokens) >= 1

    asyncio.run(run())


def test_a_request_that_can_never_fit_the_decode_pool_is_refused_at_once(pair_factory):
    # decode pool of 4 blocks: prompt 40 + 60 new tokens need 7 -> BAD_REQUEST naming the fix
    pair_factory.start("decode", "--num-blocks", "4")
    pair_factory.start("prefill", "--handoff-timeout", "30")
    with pytest.raises(client.RequestFailed) as info:
        asyncio.run(
            client.generate(
                pair_factory.client_socket,
                prompt_tokens=list(range(40)),
                sampling=SamplingParams(max_tokens=60, ignore_eos=True),
                timeout=20,
            )
        )
    assert info.value.code == "BAD_REQUEST"
    assert "--num-blocks" in str(info.value)
    st = asyncio.run(client.status(pair_factory.client_socket))
    assert st.pool["free"] == st.pool["total"]


def test_prefill_in_flight_limit_answers_no_capacity(pair_factory):
    pair_factory.start("decode")
    pair_factory.start("prefill", "--max-pending", "1")
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def run():
        first = client.stream(pair_factory.client_socket, prompt_tokens=[1, 2, 3], sampling=long)
        await anext(first)  # the first token is out: the request is in flight for 399 more steps
        with pytest.raises(client.RequestFailed) as info:
            await client.generate(pair_factory.client_socket, prompt="x", sampling=SamplingParams())
        assert info.value.code == "NO_CAPACITY"
        assert "--max-pending" in str(info.value)
        async for _ in first:
            pass

    asyncio.run(run())
    st = asyncio.run(client.status(pair_factory.client_socket))
    assert st.pool["free"] == st.pool["total"]
