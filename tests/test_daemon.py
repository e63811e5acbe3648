"""The daemon's life cycle helper: signals set a flag, shutdown is a sequence."""

from __future__ import annotations

import gc
import os
import signal
import time

from common.daemon import heap, lifecycle


class FakeServer:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def start(self) -> None:
        self.events.append("start")
        os.kill(os.getpid(), signal.SIGTERM)  # a stop request once serving

    async def shutdown(self) -> None:
        self.events.append("shutdown")


def test_sigterm_while_serving_runs_the_shutdown_sequence():
    events: list[str] = []
    code = lifecycle.run(
        lambda: lifecycle.serve_until_stopped(
            lambda: "model", lambda m, _stop: FakeServer(events), lambda m: events.append("close")
        )
    )
    assert code == 0
    assert events == ["start", "shutdown"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored
    assert gc.get_freeze_count() > 0  # the heap as it stood once serving was frozen (heap.py)
    gc.unfreeze()  # this test process's, not a daemon's
    assert not [cb for cb in gc.callbacks if isinstance(cb, heap.PauseWatch)]  # closed at stop


def test_sigterm_during_model_load_stops_cleanly_without_serving():
    events: list[str] = []

    def slow_load() -> str:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while "loading" on the worker thread
        time.sleep(0.2)
        return "model"

    code = lifecycle.run(
        lambda: lifecycle.serve_until_stopped(
            slow_load, lambda m, _stop: FakeServer(events), lambda m: events.append(f"close {m}")
        )
    )
    assert code == 0
    assert events == ["close model"]


def test_new_event_loop_is_uvloop_when_installed():
    import uvloop  # a dependency of pdkv on Linux

    loop = lifecycle.new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
