"""SIGTERM drains and exits 0; a second signal forces the exit; stale files are replaced on start
and a live daemon's are refused with exit code 3."""

from __future__ import annotations

import asyncio
import collections
import signal
import socket
import subprocess
import sys

from common import client
from common.model.sampling import SamplingParams
from tests.support.daemons import FaultPair, all_free, assert_pair_free, status
from tests.support.load import Load
from tests.support.wait import poll


def _files_gone(pair: FaultPair, role: str) -> None:
    sock = pair.runtime / ("prefill.sock" if role == "prefill" else "decode.sock")
    assert not sock.exists(), f"{role} socket left behind"
    assert not (pair.runtime / f"{role}.pid").exists(), f"{role} pidfile left behind"


def _sigterm_under_load(pair: FaultPair, role: str, seed: int) -> collections.Counter:
    load = Load(pair.client_socket, n=16, max_tokens=40, timeout=60, seed=seed)

    async def run() -> None:
        task = asyncio.create_task(load.run())
        await load.wait_tokens(16 + 16)
        pair.daemons[role].proc.send_signal(signal.SIGTERM)
        await task

    asyncio.run(run())
    assert pair.daemons[role].proc.wait(timeout=30) == 0
    _files_gone(pair, role)
    return collections.Counter(o.end for o in load.outcomes)


def test_sigterm_under_load_drains_and_exits_0(fault_pair: FaultPair, expect) -> None:  # type: ignore[no-untyped-def]
    fault_pair.start_both()
    ends = _sigterm_under_load(fault_pair, "prefill", seed=21)
    assert set(ends) <= {"FINISH", "SHUTTING_DOWN"}, ends
    assert ends["FINISH"] > 0, ends  # the drain let in-flight requests finish
    poll(lambda: all_free(fault_pair.link_socket), what="decode free after prefill drain")
    assert '"prefill_draining"' in fault_pair.daemons["prefill"].log_text()

    fault_pair.start("prefill")  # a clean restart on the same runtime dir
    ends = _sigterm_under_load(fault_pair, "decode", seed=22)
    assert set(ends) <= {"FINISH", "SHUTTING_DOWN", "LINK_LOST"}, ends
    poll(lambda: all_free(fault_pair.client_socket), what="prefill free after decode drain")
    poll(lambda: status(fault_pair.client_socket).links[0]["state"] == "down")
    assert fault_pair.daemons["prefill"].stop() == 0
    _files_gone(fault_pair, "prefill")


def _start_cli(pair: FaultPair, role: str) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "pdkv.cli",
        "--runtime-dir",
        str(pair.runtime),
        "--log-format",
        "json",
        role,
        "start",
        "--device",
        "cpu",
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_second_signal_forces_exit_then_stale_files_are_replaced(
    fault_pair: FaultPair, expect
) -> None:  # type: ignore[no-untyped-def]
    fault_pair.extra["decode"] = ["--drain-timeout", "60"]
    fault_pair.start_both()
    load = Load(fault_pair.client_socket, n=4, max_tokens=3000, timeout=60, seed=23)
    decode = fault_pair.daemons["decode"]

    async def run() -> None:
        task = asyncio.create_task(load.run())
        await load.wait_tokens(4 + 8)
        decode.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(poll, lambda: '"decode_draining"' in decode.log_text())
        decode.proc.send_signal(signal.SIGTERM)
        await task

    asyncio.run(run())
    assert decode.proc.wait(timeout=30) == 1
    assert '"forced_exit"' in decode.log_text()
    assert collections.Counter(o.end for o in load.outcomes) == {"LINK_LOST": 4}
    # os._exit left the pidfile of a dead process behind (the drain had already unlinked the
    # socket); leave a stale socket file too: a bound socket nobody listens on any more
    assert (fault_pair.runtime / "decode.pid").exists()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(fault_pair.link_socket)
    stale.close()
    assert (fault_pair.runtime / "decode.sock").is_socket()
    assert_pair_free(fault_pair)

    fault_pair.extra["decode"] = []
    fault_pair.start("decode")  # stale socket and pidfile replaced
    poll(lambda: status(fault_pair.client_socket).links[0]["state"] == "up")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    res = asyncio.run(
        client.generate(fault_pair.client_socket, prompt_tokens=[9, 8, 7], sampling=params)
    )
    assert res.tokens == expect([9, 8, 7], params)

    for role in ("decode", "prefill"):  # a live daemon's socket and pidfile are not taken over
        done = _start_cli(fault_pair, role)
        assert done.returncode == 3, (role, done.returncode, done.stderr[-2000:])
        live_pid = fault_pair.daemons[role].proc.pid
        assert f"pid {live_pid}" in done.stderr and "stop it first" in done.stderr, done.stderr
    assert_pair_free(fault_pair)
    assert fault_pair.stop_all() == {"prefill": 0, "decode": 0}
