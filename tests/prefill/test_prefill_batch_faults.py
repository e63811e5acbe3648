"""A batched prefill forward that raises fails the requests of that batch with INTERNAL, and no
other; the daemon goes on serving and frees every block. The failure is injected
(tests/support/wrapped_daemon.py: a forward over a prompt holding the poison token raises), since
nothing from outside makes the forward fail."""

from __future__ import annotations

import asyncio

from common import client
from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import Error, ErrorCode, Generate
from tests.support.daemons import BLOCK, all_free
from tests.support.prefill import burst, events, prompts
from tests.support.wait import poll

POISON = 7


def test_a_failed_forward_fails_its_batch_only_and_the_daemon_goes_on(pair_factory, tiny):  # type: ignore[no-untyped-def]
    model, _ = tiny
    pair = pair_factory
    pair.start("decode")
    prefill = pair.start(
        "prefill",
        "--max-prefill-tokens",
        "8192",  # batching on (the CPU default is one prompt a forward)
        module="tests.support.wrapped_daemon",
        env={"PDKVTEST_FAIL_PREFILL_TOKEN": str(POISON)},
    )
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    healthy = [[t for t in p if t != POISON] or [1] for p in prompts(8, [12, 30, 45, 9])]
    gens = [
        Generate(sampling=params, prompt_tokens=p, request_id=f"h{i}", stream=False)
        for i, p in enumerate(healthy)
    ]
    gens.insert(3, Generate(sampling=params, prompt_tokens=[5, POISON, 9], request_id="bad"))
    got = asyncio.run(burst(pair.client_socket, gens))

    assert isinstance(got["bad"], Error) and got["bad"].code == ErrorCode.INTERNAL
    assert "injected failure" in got["bad"].message
    failed = {rid for b in events(pair, "prefill_batch_failed") for rid in b["request_ids"]}
    assert "bad" in failed
    for i, p in enumerate(healthy):
        out = got[f"h{i}"]
        if f"h{i}" in failed:  # it shared the failed forward
            assert isinstance(out, Error) and out.code == ErrorCode.INTERNAL, out
        else:
            assert out == reference.generate(model, p, params, block_size=BLOCK), f"h{i}"

    again = asyncio.run(
        client.generate(pair.client_socket, prompt_tokens=healthy[0], sampling=params)
    )
    assert again.tokens == reference.generate(model, healthy[0], params, block_size=BLOCK)
    poll(lambda: all_free(pair.client_socket), what="prefill pool all free")
    assert prefill.proc.poll() is None
    assert pair.stop_all() == {"prefill": 0, "decode": 0}
