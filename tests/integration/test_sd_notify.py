"""systemd readiness (Type=notify) on real daemons, with a real datagram socket as NOTIFY_SOCKET:
decode is READY once its socket listens, prefill only once its link is up; both say STOPPING=1
when the drain begins."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from common import client
from common.daemon.notify import notify
from tests.support.daemons import Pair, wait_ready


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, Path]]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    yield sock, path
    sock.close()


def _recv(sock: socket.socket, timeout: float = 120) -> str:
    sock.settimeout(timeout)
    return sock.recv(4096).decode()


def _nothing_queued(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(4096)
    except BlockingIOError:
        return True
    return False


def test_notify_without_socket_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False


def test_notify_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"pdkv-test-{id(monkeypatch)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("READY=1", "STATUS=ok") is True
        assert sock.recv(100) == b"READY=1\nSTATUS=ok"


def test_ready_after_listen_and_link_stopping_on_drain(
    pair_factory: Pair, notify_socket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    # prefill first: it listens, but with no decode it must not report READY
    prefill = pair_factory.start("prefill", wait=False)
    wait_ready(prefill)
    st = asyncio.run(client.status(pair_factory.client_socket))
    assert st.links[0]["state"] == "down"
    assert _nothing_queued(sock), "prefill said READY=1 without a link"

    decode = pair_factory.start("decode", wait=False)
    ready = [_recv(sock), _recv(sock)]  # decode's, then prefill's once its link comes up
    assert ready == ["READY=1\nSTATUS=serving"] * 2, ready
    assert asyncio.run(client.status(pair_factory.link_socket)).role == "decode"
    assert asyncio.run(client.status(pair_factory.client_socket)).links[0]["state"] == "up"

    decode.proc.send_signal(signal.SIGTERM)
    assert _recv(sock) == "STOPPING=1\nSTATUS=draining"
    assert decode.proc.wait(timeout=60) == 0
    prefill.proc.send_signal(signal.SIGTERM)
    assert _recv(sock) == "STOPPING=1\nSTATUS=draining"
    assert prefill.proc.wait(timeout=60) == 0
