"""Real daemons on real sockets, placed on CPUs as docs/operations.md's "CPU placement" says:
a decode with a CPU of its own polls its link for each early HANDOFF's KV_READY (instead of
sleeping in epoll through the prefill's forward), a decode sharing its CPUs with the prefill
never does; either way both loop threads ask the kernel for a short slice, the torch threads
keep the default (common/daemon/sched.py)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from common import client
from common.daemon import sched
from common.sampling_params import SamplingParams
from tests.support.daemons import Pair, wait_ready

REQUESTS = 12


def _events(log: str, event: str) -> list[dict]:
    out = []
    for line in log.splitlines():
        if line.startswith("{") and event in line:
            rec = json.loads(line)
            if rec.get("event") == event:
                out.append(rec)
    return out


def _slices(pid: int) -> tuple[int, list[int]]:
    """The se.slice (ns) of `pid`'s main thread and of its other threads (a kernel that takes
    slices shows them: _kernel_takes_slices first)."""
    main, others = 0, []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "sched").read_text()
        line = next((x for x in text.splitlines() if x.startswith("se.slice")), None)
        if line is None:
            continue
        value = int(line.split(":")[1])
        if int(task.name) == pid:
            main = value
        else:
            others.append(value)
    return main, others


def _kernel_takes_slices() -> bool:
    def probe() -> bool:
        try:
            if not sched.set_slice(sched.LOOP_SLICE_US):
                return False
            text = Path("/proc/thread-self/sched").read_text()
            return f"{sched.LOOP_SLICE_US * 1000}" in text.split("se.slice", 1)[1].split("\n")[0]
        except (OSError, IndexError):
            return False
        finally:
            sched.default_slice()

    return asyncio.run(asyncio.to_thread(probe))


async def _generate(pair: Pair, n: int) -> None:
    params = SamplingParams(max_tokens=2, ignore_eos=True)  # max_tokens > 1: an early HANDOFF
    for i in range(n):
        prompt = [(i + j) % 250 for j in range(40)]
        res = await client.generate(pair.client_socket, prompt_tokens=prompt, sampling=params)
        assert res.finish is not None and len(res.tokens) == 2


Slices = list[tuple[int, list[int]]]


def _run(pair: Pair) -> tuple[dict, dict, Slices]:
    asyncio.run(_generate(pair, REQUESTS))
    slices: Slices = []
    if _kernel_takes_slices():  # else /proc shows no se.slice (before 6.6, no SCHED_DEBUG)
        slices = [_slices(pair.daemons[role].proc.pid) for role in ("decode", "prefill")]
    assert pair.stop_all() == {"prefill": 0, "decode": 0}
    log = pair.daemons["decode"].log_text()
    (registered,) = _events(log, "peer_registered")
    (stopped,) = _events(log, "decode_loop_stopped")
    return registered, stopped, slices


def _check_slices(daemons: Slices) -> None:
    for main, others in daemons:
        assert main == sched.LOOP_SLICE_US * 1000
        # the threads made before it (the model's load) keep the default, and the torch
        # thread, made after, resets it (threads the loop starts later would inherit it)
        assert others and all(s != main for s in others)


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to pin the decode apart",
)
def test_a_decode_on_a_cpu_of_its_own_polls_for_the_kv_ready(pair_factory: Pair) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    decode = pair_factory.start("decode", wait=False)
    os.sched_setaffinity(decode.proc.pid, {cpus[-1]})  # before it starts a thread
    wait_ready(decode)
    prefill = pair_factory.start("prefill", wait=False)
    os.sched_setaffinity(prefill.proc.pid, set(cpus[:-1]))
    wait_ready(prefill, linked=True)
    registered, stopped, slices = _run(pair_factory)
    assert registered["cpus_apart"] is True
    # early HANDOFFs' KV_READYs were read by the poll (a forward of the tiny model takes ms, the
    # poll lasts up to 50 ms; on a loaded machine some may still come through epoll)
    assert stopped["kv_ready_polled"] >= 1
    _check_slices(slices)


def test_a_decode_sharing_its_cpus_never_polls(pair: Pair) -> None:
    registered, stopped, slices = _run(pair)
    assert registered["cpus_apart"] is False
    assert stopped["kv_ready_polled"] == 0
    _check_slices(slices)
