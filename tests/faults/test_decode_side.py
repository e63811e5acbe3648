"""The decode daemon against a hand-driven prefill (heartbeat loss) and against a foreign uid
(SO_PEERCRED), plus the modes of its runtime dir and socket."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.model.sampling import SamplingParams
from common.protocol import ConnectionClosed, Finish, Handoff, StepTokens, Tokens
from tests.support.daemons import FaultPair, all_free, status
from tests.support.fakes import FakePrefill
from tests.support.wait import poll

NOBODY = 65534

# Connects as `uid` (unless "root"), sends a STATUS frame, prints "pid bytes-received".
_CONNECT_AS = r"""
import os, socket, struct, sys
if sys.argv[2] != "root":
    os.setgroups([]); os.setgid(65534); os.setuid(int(sys.argv[2]))
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect(sys.argv[1])
data = b""
try:
    s.sendall(struct.pack("!4sHHIII", b"PDKV", 2, 21, 2, 0, 0) + b"{}")
    while chunk := s.recv(4096):
        data += chunk
        if len(data) >= 20 and sys.argv[2] == "root":
            break
except (BrokenPipeError, ConnectionResetError):
    pass
print(os.getpid(), len(data))
"""


@pytest.fixture(scope="module")
def dpair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultPair]:
    outer = Path(tempfile.mkdtemp(prefix="pdkv-acc-"))
    os.chmod(outer, 0o711)  # traversable, so uid 65534 can reach a socket the daemon opens to it
    runtime = outer / "rt"
    runtime.mkdir(mode=0o755)
    os.chmod(runtime, 0o755)  # too open: the daemon must tighten it to 0700
    pair = FaultPair(runtime, log_dir=Path(tmp_path_factory.mktemp("dlog", numbered=True)))
    pair.start("decode", "--heartbeat-timeout", "1", "--socket-group", "nogroup")
    yield pair
    pair.kill_all()
    shutil.rmtree(outer, ignore_errors=True)


def _log_events(pair: FaultPair, event: str) -> list[dict]:
    lines = pair.daemons["decode"].log_text().splitlines()
    out = []
    for line in lines:
        if f'"{event}"' in line:
            out.append(json.loads(line))
    return out


def test_runtime_dir_0700_socket_0660_with_group(dpair: FaultPair) -> None:
    assert stat.S_IMODE(os.stat(dpair.runtime).st_mode) == 0o700
    st = os.stat(dpair.link_socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == grp.getgrnam("nogroup").gr_gid
    pid = int((dpair.runtime / "decode.pid").read_text())
    assert pid == dpair.daemons["decode"].proc.pid


def test_silent_prefill_is_dropped_with_its_sequences(dpair: FaultPair, tiny_model) -> None:  # type: ignore[no-untyped-def]
    model, _ = tiny_model
    fake = FakePrefill(model)
    prompt = [7] * 20
    handoff = Handoff(
        request_id="hb-1",
        block_ids=[0, 1],
        num_tokens=len(prompt),
        prompt_tokens=prompt,
        first_token=3,
        sampling=SamplingParams(max_tokens=4000, ignore_eos=True),
    )

    async def run() -> list[object]:
        ok = await fake.link(dpair.link_socket)
        assert ok.link_id
        assert fake.channel is not None
        await fake.channel.send(handoff)  # then silence: no PING ever
        got: list[object] = []
        with pytest.raises(ConnectionClosed):
            while True:
                got.append(await asyncio.wait_for(fake.channel.recv(), 15))
        return got

    try:
        got = asyncio.run(run())
    finally:
        fake.close()
    steps = [m for m in got if isinstance(m, StepTokens)]  # one frame per step (v10)
    assert steps and all(m.request_ids == ["hb-1"] for m in steps), got[:3]
    assert not any(isinstance(m, Tokens | Finish) for m in got), got[:3]
    assert not any(m.finishes for m in steps)

    def clean() -> bool:
        st = status(dpair.link_socket)
        return st.inflight == 0 and not st.links and all_free(dpair.link_socket)

    poll(clean, what="decode dropped the silent link and freed its blocks")
    assert _log_events(dpair, "link_heartbeat_missed")
    dropped = _log_events(dpair, "link_lost_sequences_dropped")
    assert dropped and dropped[-1]["dropped"] == 1


def _connect_as(sock: str, who: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _CONNECT_AS, sock, who],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    pid, nbytes = out.stdout.split()
    return int(pid), int(nbytes)


def test_foreign_uid_is_refused_and_logged(dpair: FaultPair) -> None:
    os.chmod(dpair.runtime, 0o711)  # let uid 65534 reach the 0660 nogroup socket
    try:
        pid, nbytes = _connect_as(dpair.link_socket, str(NOBODY))
    finally:
        os.chmod(dpair.runtime, 0o700)
    assert nbytes == 0, "a refused peer must get no answer at all"
    refusals = poll(lambda: _log_events(dpair, "peer_refused"), what="peer_refused logged")
    assert any(r["peer_pid"] == pid and r["peer_uid"] == NOBODY for r in refusals), refusals
    # the same frame from our own uid is answered: the refusal was the uid check
    _, nbytes = _connect_as(dpair.link_socket, "root")
    assert nbytes > 20
    assert all_free(dpair.link_socket)
