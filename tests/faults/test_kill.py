"""kill -9 of either daemon with requests in flight: every client is answered, nothing leaks, and
the pair recovers once the killed daemon is started again."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
from collections.abc import Iterator

import pytest

from common import client
from common.model.sampling import SamplingParams
from tests.support.daemons import FaultPair, all_free, assert_pair_free, new_pair, status
from tests.support.load import Load
from tests.support.wait import poll


@pytest.fixture  # one pair per test: a scenario that fails must not leave the next a dead daemon
def kpair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultPair]:
    pair = new_pair(tmp_path_factory, "kill")
    # requests not handed off when the decode dies wait this long for the link to come back,
    # then fail LINK_LOST (the default 30 s made the 60-request kill take 31 s; the wait itself
    # is tested in test_fake_decode.py)
    pair.extra["prefill"] = ["--handoff-timeout", "3"]
    pair.start_both()
    yield pair
    pair.kill_all()


def _link_state(pair: FaultPair) -> str:
    return str(status(pair.client_socket).links[0]["state"])


def _check_one_request(pair: FaultPair, expect, seed: int) -> None:  # type: ignore[no-untyped-def]
    prompt = [(seed * 37 + i) % 256 for i in range(23)]
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    res = asyncio.run(client.generate(pair.client_socket, prompt_tokens=prompt, sampling=params))
    assert res.tokens == expect(prompt, params)
    assert res.finish is not None and res.finish.reason == "length"


def test_kill_decode_with_60_requests_in_flight(kpair: FaultPair, expect) -> None:  # type: ignore[no-untyped-def]
    load = Load(kpair.client_socket, n=60, max_tokens=200, timeout=60)
    decode_pid = kpair.daemons["decode"].proc.pid

    async def run() -> None:
        task = asyncio.create_task(load.run())
        await load.wait_tokens(60 + 120)  # every first token, and decode tokens flowing
        os.kill(decode_pid, signal.SIGKILL)
        await task

    asyncio.run(run())
    kpair.daemons["decode"].proc.wait(timeout=10)
    ends = collections.Counter(o.end for o in load.outcomes)
    assert set(ends) <= {"FINISH", "LINK_LOST"}, ends
    assert ends["LINK_LOST"] > 0, ends
    for o in load.outcomes:
        if o.end == "FINISH":
            assert len(o.tokens) == 200
    poll(lambda: all_free(kpair.client_socket), what="prefill pool all free after decode death")
    assert _link_state(kpair) == "down"

    kpair.start("decode")  # a stale socket and pidfile are left by kill -9: replaced on start
    poll(lambda: _link_state(kpair) == "up", what="prefill link back up")
    assert status(kpair.client_socket).links[0]["connects"] >= 2
    _check_one_request(kpair, expect, seed=1)
    assert_pair_free(kpair)


def test_kill_prefill_with_requests_in_decode(kpair: FaultPair, expect) -> None:  # type: ignore[no-untyped-def]
    load = Load(kpair.client_socket, n=20, max_tokens=400, timeout=60, seed=12)
    prefill_pid = kpair.daemons["prefill"].proc.pid

    async def run() -> None:
        task = asyncio.create_task(load.run())
        await load.wait_tokens(20 + 40)
        inflight = (await client.status(kpair.link_socket)).inflight
        os.kill(prefill_pid, signal.SIGKILL)
        await task
        assert inflight > 0, "the decode held no sequence when the prefill died"

    asyncio.run(run())
    kpair.daemons["prefill"].proc.wait(timeout=10)
    assert all(o.end not in ("FINISH", "HUNG") for o in load.outcomes), load.outcomes

    def decode_clean() -> bool:
        st = status(kpair.link_socket)
        return st.inflight == 0 and not st.links and all_free(kpair.link_socket)

    poll(decode_clean, what="decode dropped the dead prefill's sequences and freed their blocks")
    assert "link_lost_sequences_dropped" in kpair.daemons["decode"].log_text()

    assert (kpair.runtime / "prefill.sock").is_socket()  # kill -9 leaves both behind
    assert (kpair.runtime / "prefill.pid").exists()
    kpair.start("prefill")
    _check_one_request(kpair, expect, seed=2)
    assert_pair_free(kpair)
