"""A decode that completes the handshake and then reads nothing: the prefill's HANDOFF writes
block on the full socket until the heartbeat watchdog ends the link. Found in review: closing the
link under a blocked write aborted the whole prefill process (uvloop)."""

from __future__ import annotations

import asyncio
import collections
import os
from pathlib import Path

import pytest

from common import client
from common.model.sampling import SamplingParams
from tests.support.daemons import FaultPair, all_free, status, wait_ready
from tests.support.fakes import FakeDecode
from tests.support.wait import poll

PROMPT_TOKENS = 8000  # each HANDOFF carries ~32 KB of prompt ids: a few fill the socket
REQUESTS = 16


def test_writes_blocked_on_a_hung_decode_end_in_link_lost_and_the_prefill_lives(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = Path(tmp_path_factory.mktemp("stall", numbered=True))
    os.chmod(path, 0o700)
    fake = FakeDecode(path / "fake-decode.sock")
    fake.stalled = True
    fake.start()
    pair = FaultPair(path)
    try:
        d = pair.start(
            "prefill",
            "--link-socket",
            str(fake.path),
            "--num-blocks",
            str(REQUESTS * (PROMPT_TOKENS // 16 + 1)),
            "--heartbeat-timeout",
            "8",
            "--handoff-timeout",
            "3",
            wait=False,
        )
        wait_ready(d, linked=True)
        fake.accept = False  # once the hung link is dropped, it stays down
        params = SamplingParams(max_tokens=4, ignore_eos=True)

        async def one(i: int) -> str:
            try:
                await client.generate(
                    pair.client_socket,
                    prompt_tokens=[100 + i] * PROMPT_TOKENS,
                    sampling=params,
                    timeout=60,
                )
            except client.RequestFailed as exc:
                return str(exc.code)
            except (OSError, client.PdkvError, TimeoutError) as exc:
                return type(exc).__name__
            return "FINISH"

        async def run() -> list[str]:
            return list(await asyncio.gather(*(one(i) for i in range(REQUESTS))))

        ends = collections.Counter(asyncio.run(run()))
        assert d.proc.poll() is None, f"the prefill died:\n{d.log_text()[-3000:]}"
        assert set(ends) == {"LINK_LOST"}, ends
        poll(lambda: status(pair.client_socket).links[0]["state"] == "down", what="link down")
        # the watchdog ended it (later reconnects fail on the closed listener, and say so)
        assert "nothing received for 8" in d.log_text()
        poll(lambda: all_free(pair.client_socket), what="prefill pool free after the hung link")
        assert status(pair.client_socket).inflight == 0
    finally:
        pair.kill_all()
        fake.stop()
