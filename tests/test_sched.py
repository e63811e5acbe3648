"""common.daemon.sched: the loop thread's scheduler slice and whether two processes share a CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common.daemon import sched


def _slice_ns(path: str = "/proc/thread-self/sched") -> int | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("se.slice"):
            return int(line.split(":")[1])
    return None


def test_a_short_slice_for_this_thread_only_and_back_to_the_default() -> None:
    before = _slice_ns()
    if before is None or not sched.set_slice(sched.LOOP_SLICE_US):
        pytest.skip("no per-thread slice on this kernel")
    try:
        if _slice_ns() != sched.LOOP_SLICE_US * 1000:
            pytest.skip("this kernel ignores a SCHED_OTHER thread's requested slice (< 6.12)")
        seen: list[int | None] = []

        def child() -> None:  # a thread inherits its creator's slice: the torch thread resets
            seen.append(_slice_ns())
            sched.default_slice()
            seen.append(_slice_ns())

        t = threading.Thread(target=child)
        t.start()
        t.join()
        assert seen == [sched.LOOP_SLICE_US * 1000, before]
        assert _slice_ns() == sched.LOOP_SLICE_US * 1000  # the caller's own is unchanged
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    finally:
        sched.default_slice()
    assert _slice_ns() == before


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_cpus_apart_only_for_a_process_on_none_of_our_cpus() -> None:
    assert not sched.cpus_apart(os.getpid())  # ourselves
    assert not sched.cpus_apart(0) and not sched.cpus_apart(2**22 + 12345)  # none, gone
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.sched_setaffinity(child.pid, {cpus[-1]})
        assert not sched.cpus_apart(child.pid)  # it may run on one of ours
        mine = os.sched_getaffinity(0)
        os.sched_setaffinity(0, set(cpus[:-1]))
        try:
            assert sched.cpus_apart(child.pid)
        finally:
            os.sched_setaffinity(0, mine)
    finally:
        child.kill()
        child.wait()
