"""The NIXL worker's poll schedule: it backs off while a notification is awaited and a `hurry`
(the decode got a push's KV_READY) makes it poll closely again. The agent is a stand-in that
only answers polls: the schedule is the worker's, not NIXL's."""

from __future__ import annotations

import asyncio
import threading
import time

from common.transfer import nixl_worker
from common.transfer.nixl_worker import NixlWorker, Peers


class _QuietAgent:
    """Answers the worker's notification polls with nothing, counting them."""

    def __init__(self) -> None:
        self.polls = 0

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.polls += 1
        return {}


def _wait_for(cond, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


async def test_a_hurry_ends_the_backoff_of_a_worker_awaiting_a_notification(monkeypatch):
    pauses: list[float] = []
    lock = threading.Lock()
    real_pause = nixl_worker._pause

    def recorded(idle: int) -> float:
        pause = real_pause(idle)
        with lock:
            pauses.append(pause)
        return pause

    monkeypatch.setattr(nixl_worker, "_pause", recorded)
    agent = _QuietAgent()
    loop = asyncio.get_running_loop()
    worker = NixlWorker(agent, "VRAM", 0, Peers(agent), loop, "test-nixl-worker")
    try:
        worker.submit("expect", (("prefill", b"pdkv-push:1"), lambda exc: None))
        # nothing arrives: the worker backs off to its longest pause
        assert _wait_for(lambda: pauses and pauses[-1] == 0.001)
        with lock:
            before = len(pauses)
        worker.submit("hurry", None)
        assert _wait_for(lambda: len(pauses) > before + 1)
        with lock:
            after = pauses[before:]
        assert after[0] == 0.0, after[:4]  # the close polls again, at once
        polls = agent.polls
        assert _wait_for(lambda: agent.polls > polls)  # it still polls (it did not stop)
    finally:
        worker.stop()
