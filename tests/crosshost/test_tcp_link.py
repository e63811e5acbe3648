"""The TCP link's pieces: addresses, the key file, the proofs, fds refused, and the daemons'
startup checks of --listen / --decode (each refused with one clear line before the model loads)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import PdkvError, ProtocolError
from common.protocol import Ping
from common.wire.channel import FrameChannel
from common.wire.tcplink import load_link_key, parse_tcp, proof, proof_ok

KEY = b"0123456789abcdef0123456789abcdef"


def _key_file(tmp_path: Path, data: bytes = KEY, mode: int = 0o600) -> Path:
    path = tmp_path / "link.key"
    path.write_bytes(data + b"\n")
    path.chmod(mode)
    return path


def test_addresses_parse_and_bad_ones_say_the_form():
    assert parse_tcp("tcp://10.0.0.2:7000") == ("10.0.0.2", 7000)
    assert parse_tcp("tcp://[::1]:7000") == ("::1", 7000)
    for bad in ("10.0.0.2:7000", "tcp://10.0.0.2", "unix:///x", "tcp://h:99999", "tcp://h:1/x"):
        with pytest.raises(ValueError, match="tcp://ADDRESS:PORT"):
            parse_tcp(bad)


def test_the_key_file_must_be_owner_only_and_long_enough(tmp_path: Path):
    assert load_link_key(_key_file(tmp_path)) == KEY
    with pytest.raises(PdkvError, match=r"mode 0644.*chmod 600"):
        load_link_key(_key_file(tmp_path, mode=0o644))
    with pytest.raises(PdkvError, match="at least 16"):
        load_link_key(_key_file(tmp_path, data=b"short"))
    with pytest.raises(PdkvError, match="cannot read"):
        load_link_key(tmp_path / "missing")


def test_a_proof_holds_only_for_the_same_key_role_and_nonces():
    good = proof(KEY, "decode", "aa", "bb")
    assert proof_ok(KEY, "decode", "aa", "bb", good)
    assert not proof_ok(KEY + b"x", "decode", "aa", "bb", good)
    assert not proof_ok(KEY, "prefill", "aa", "bb", good)  # a decode's proof never passes as ours
    assert not proof_ok(KEY, "decode", "aa", "bc", good)
    assert not proof_ok(KEY, "decode", "aa", "bb", "")
    assert not proof_ok(KEY, "decode", "aa", "bb", "é" * 64)


async def test_a_frame_with_fds_is_refused_on_a_tcp_link_and_plain_frames_pass():
    listen = socket.create_server(("127.0.0.1", 0))
    loop = asyncio.get_running_loop()
    client = socket.socket()
    client.setblocking(False)
    listen.setblocking(False)
    accept = loop.create_task(loop.sock_accept(listen))
    await loop.sock_connect(client, listen.getsockname())
    server, _ = await accept
    a, b = FrameChannel(client, max_fds=0), FrameChannel(server, max_fds=0)
    r, w = os.pipe()
    try:
        with pytest.raises(ProtocolError, match="TCP"):
            await a.send(Ping(seq=1), [r])
        await a.send(Ping(seq=2))
        assert await asyncio.wait_for(b.recv(), 5) == Ping(seq=2)
    finally:
        os.close(r)
        os.close(w)
        a.close()
        b.close()
        listen.close()


def _start(tmp_path: Path, role: str, *args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(tmp_path / "rt")]
    argv += [role, "start", "--device", "cpu", *args]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


@pytest.mark.parametrize("role,option", [("decode", "--listen"), ("prefill", "--decode")])
def test_a_tcp_link_without_a_good_key_or_nixl_does_not_start(tmp_path: Path, role, option):
    addr = "tcp://127.0.0.1:1"
    res = _start(tmp_path, role, option, addr)
    assert res.returncode != 0 and "needs --link-key-file" in res.stderr
    loose = _key_file(tmp_path, mode=0o640)
    res = _start(tmp_path, role, option, addr, "--link-key-file", str(loose))
    assert res.returncode != 0 and "chmod 600" in res.stderr
    # NIXL missing: a package of that name that fails to import, first on the path
    fake = tmp_path / "nonixl" / "nixl_cu13"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed here')\n")
    loose.chmod(0o600)
    env = {"PYTHONPATH": os.pathsep.join([str(fake.parent), os.getcwd()])}
    res = _start(tmp_path, role, option, addr, "--link-key-file", str(loose), env=env)
    assert res.returncode != 0 and "pip install 'pdkv[nixl]'" in res.stderr
