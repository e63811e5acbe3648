"""Connections, fds, deadlines and log size against real daemons, attacked from raw sockets:
no connection or peer may leave a daemon alive but unable to serve, or size its memory or log."""

from __future__ import annotations

import array
import asyncio
import os
import socket
import time
from collections.abc import Iterator

import msgspec
import pytest

from common import client
from common.errors import ProtocolError
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from common.protocol import (
    PROTOCOL_VERSION,
    ConnectionClosed,
    Error,
    ErrorCode,
    Generate,
    Hello,
    Ping,
    Register,
    Status,
    decode,
    encode,
)
from tests.support.daemons import FaultPair, all_free, new_pair, status
from tests.support.fakes import FakePrefill
from tests.support.wait import poll

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        lines = fh.read().splitlines()
    for line in lines:
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def connect(path: str, timeout: float = 10) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def read_to_eof(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def served(pair: FaultPair) -> bool:
    """One request answered in full (False when refused, e.g. NO_CAPACITY)."""
    try:
        got = asyncio.run(
            client.generate(pair.client_socket, prompt_tokens=[3, 4], sampling=GREEDY, timeout=20)
        )
    except client.RequestFailed:
        return False
    return len(got.tokens) == 8


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    return load_model(None)


@pytest.fixture(scope="module")
def lpair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultPair]:
    """A pair with short deadlines and a small connection cap on the prefill."""
    pair = new_pair(tmp_path_factory, "lim")
    pair.extra["prefill"] = [
        *("--frame-timeout", "1", "--client-idle-timeout", "2"),
        *("--client-write-timeout", "1", "--max-connections", "200"),
    ]
    pair.extra["decode"] = ["--frame-timeout", "1"]

    pair.start_both()
    yield pair
    pair.kill_all()


def test_accept_survives_running_out_of_fds(tmp_path_factory):
    pair = new_pair(tmp_path_factory, "emfile")
    held: list[socket.socket] = []
    try:
        pair.start("decode")
        prefill = pair.start(
            "prefill", module="tests.support.wrapped_daemon", env={"PDKVTEST_NOFILE": "256"}
        )
        held += [connect(pair.client_socket) for _ in range(300)]  # more than its fd limit
        poll(lambda: "accept_failed" in prefill.log_text(), what="EMFILE logged")
        while held:
            held.pop().close()
        assert poll(lambda: served(pair), what="serving again after EMFILE")
        assert "accept_recovered" in prefill.log_text()
    finally:
        for s in held:
            s.close()
        pair.kill_all()


def test_connections_past_the_cap_are_refused_clearly(tmp_path_factory):
    pair = new_pair(tmp_path_factory, "cap")
    held: list[socket.socket] = []
    try:
        pair.start("decode")
        pair.start("prefill", "--max-connections", "3")
        held += [connect(pair.client_socket) for _ in range(3)]
        refused = connect(pair.client_socket)
        err = decode(read_to_eof(refused))
        refused.close()
        assert isinstance(err, Error) and err.code == ErrorCode.NO_CAPACITY
        assert "limit is 3" in err.message and "--max-connections" in err.message
        held.pop().close()
        assert poll(lambda: served(pair), what="a slot frees when a connection closes")
    finally:
        for s in held:
            s.close()
        pair.kill_all()


def test_fds_on_frames_that_expect_none_are_closed_at_once(lpair):
    pid = lpair.daemons["prefill"].proc.pid
    r, w = os.pipe()
    try:
        before = fd_count(pid)
        s = connect(lpair.client_socket)
        fds = [r] * 16
        for _ in range(20):
            frame = encode(Status())
            s.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        s.settimeout(10)
        got = b""
        while got.count(b"PDKV") < 20:  # 20 STATUS_REPLY, each starts with the magic
            got += s.recv(65536)
        assert fd_count(pid) <= before + 2, "the 320 fds sent must not be held"
        s.close()
    finally:
        os.close(r)
        os.close(w)


def test_idle_client_connections_cost_little_memory(lpair):
    pid = lpair.daemons["prefill"].proc.pid
    before = rss_kib(pid)
    conns = []
    for _ in range(150):
        s = connect(lpair.client_socket)
        s.sendall(encode(Status()))
        conns.append(s)
    for s in conns:
        assert s.recv(65536).startswith(b"PDKV")
    grown = rss_kib(pid) - before
    for s in conns:
        s.close()
    assert grown < 12 * 1024, f"150 idle connections took {grown} KiB"  # 256 KiB each before


def test_a_trickled_frame_is_cut_at_the_frame_deadline(lpair):
    frame = encode(Generate(sampling=GREEDY, prompt_tokens=list(range(3, 40))))
    s = connect(lpair.client_socket)
    cut = False
    for i in range(len(frame)):  # one byte every 0.1 s: ~20 s for the whole frame
        try:
            s.send(frame[i : i + 1])
        except (BrokenPipeError, ConnectionResetError):
            cut = True
            break
        time.sleep(0.1)
    s.close()
    assert cut, "a frame trickled over many times --frame-timeout was never cut"
    assert served(lpair)


def test_a_trickled_frame_on_an_established_link_is_cut_too(lpair, tiny):
    fake = FakePrefill(tiny[0])
    ping = encode(Ping(seq=1))

    async def trickle() -> bool:
        await fake.link(lpair.link_socket)
        ch = fake.channel
        assert ch is not None
        for _ in range(10):  # ~3 s a frame, a byte every 0.1 s: never silent for long
            for i in range(len(ping)):
                try:
                    await ch.send_bytes(ping[i : i + 1])
                except OSError:
                    return True
                await asyncio.sleep(0.1)
            try:  # the PONG, unless the decode cut the link
                await asyncio.wait_for(ch.recv(), 5)
            except (ConnectionClosed, OSError, ProtocolError):
                return True
        return False

    try:
        assert asyncio.run(trickle()), "a frame trickled past --frame-timeout was never cut"
    finally:
        fake.close()


def test_idle_client_connections_are_closed(lpair):
    s = connect(lpair.client_socket, timeout=30)
    assert s.recv(1) == b""  # EOF: closed by the daemon after --client-idle-timeout
    s.close()


def test_a_client_that_does_not_read_its_stream_has_its_request_aborted(lpair):
    # more output than the socket's buffer and the 256 KiB the prefill queues for a client
    # before its requests wait for it (prefill_server/client_writer.py): ~80 bytes a token
    gen = Generate(
        sampling=SamplingParams(max_tokens=7000, ignore_eos=True),
        prompt_tokens=[5, 6, 7],
        request_id="never-read",
        stream=True,
    )
    s = connect(lpair.client_socket)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(encode(gen))
    # the client stays connected and reads nothing; the request must still end and free
    poll(lambda: status(lpair.client_socket).inflight == 0, what="prefill request aborted")
    poll(lambda: all_free(lpair.client_socket), what="prefill blocks freed")
    poll(lambda: all_free(lpair.link_socket), what="decode blocks freed")
    assert "client_not_reading" in lpair.daemons["prefill"].log_text()
    s.close()
    assert served(lpair)


def test_peer_strings_are_cut_before_they_reach_the_log(lpair, tiny):
    log = lpair.daemons["decode"].log
    before = log.stat().st_size
    hello = Hello(
        protocol_version=PROTOCOL_VERSION, fingerprint="F" * 3_000_000, backend="shm", pid=1
    )
    s = connect(lpair.link_socket)
    s.sendall(encode(hello))
    reply = decode(read_to_eof(s))
    s.close()
    assert isinstance(reply, Error) and reply.code == ErrorCode.INCOMPATIBLE
    fake = FakePrefill(tiny[0])

    async def shout() -> None:
        await fake.link(lpair.link_socket)
        assert fake.channel is not None
        await fake.channel.send(Error(code=ErrorCode.INTERNAL, message="E" * 3_000_000))
        await fake.channel.send(Status())
        await asyncio.wait_for(fake.channel.recv(), 10)  # the ERROR was handled before this

    asyncio.run(shout())
    fake.close()
    poll(lambda: "peer_reported_error" in log.read_text(errors="replace"), what="logged")
    assert log.stat().st_size - before < 64 * 1024


def test_hello_protocol_version_is_checked(lpair):
    s = connect(lpair.link_socket)
    s.sendall(encode(Hello(protocol_version=99, fingerprint="x", backend="shm", pid=1)))
    reply = decode(read_to_eof(s))
    s.close()
    assert isinstance(reply, Error) and reply.code == ErrorCode.INCOMPATIBLE
    assert "99" in reply.message and str(PROTOCOL_VERSION) in reply.message


def test_register_with_a_malformed_event_segment_is_a_bad_request(lpair, tiny):
    fake = FakePrefill(tiny[0])

    async def register() -> Error:
        ch = await asyncio.wait_for(_hello(fake, lpair.link_socket), 10)
        fds = fake.region.fds()
        reg = Register.build(fake.layout.to_wire(), [fake.region.desc], [len(fds)], [])
        reg = msgspec.structs.replace(
            reg, event_count=2, event_handle_size=64, event_handles=b"x" * 10
        )
        await ch.send(reg, fds)
        reply = await asyncio.wait_for(ch.recv(), 10)
        ch.close()
        return reply

    reply = asyncio.run(register())
    fake.close()
    assert isinstance(reply, Error) and reply.code == ErrorCode.BAD_REQUEST, reply
    assert "event" in reply.message


async def _hello(fake: FakePrefill, path: str):  # type: ignore[no-untyped-def]
    from common.wire.channel import connect as fconnect

    ch = await fconnect(path)
    hello = Hello(
        protocol_version=PROTOCOL_VERSION, fingerprint=fake.fingerprint, backend="shm", pid=1
    )
    await ch.send(hello)
    await ch.recv()
    return ch


def test_incompatible_names_the_field_that_differs(tmp_path_factory):
    pair = new_pair(tmp_path_factory, "bs")
    try:
        pair.start("decode", "--block-size", "16")
        pair.start("prefill", "--block-size", "32", wait=False)
        err = poll(lambda: status(pair.client_socket).links[0]["last_error"], what="link refused")
        assert "INCOMPATIBLE" in err and "block_size 32 ≠ 16" in err, err
    finally:
        pair.kill_all()
