"""FrameChannel over real Unix sockets: whole frames both ways, big frames, fds, EOF, close."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator

import pytest

from common.errors import PdkvError, ProtocolError
from common.protocol import (
    HEADER_SIZE,
    MAX_META_BYTES,
    PROTOCOL_VERSION,
    ConnectionClosed,
    Message,
    MsgType,
    Ping,
    Pong,
    Register,
    Tokens,
    encode,
)
from common.protocol.frame import HEADER
from common.wire.channel import MAX_FDS_PER_MSG, FrameChannel, connect


@pytest.fixture
async def pair() -> AsyncIterator[tuple[FrameChannel, FrameChannel]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = FrameChannel(a), FrameChannel(b)
    yield left, right
    left.close()
    right.close()


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def _memfd(content: bytes) -> int:
    fd = os.memfd_create("pdkv-test")
    os.write(fd, content)
    return fd


def _tokens_at_meta_size(size: int, rid: str = "big") -> Tokens:
    """A TOKENS message whose metadata is exactly `size` bytes."""
    empty = len(encode(Tokens(request_id=rid, tokens=[], text=""))) - HEADER_SIZE
    return Tokens(request_id=rid, tokens=[], text="x" * (size - empty))


async def _recv_n(ch: FrameChannel, n: int) -> list[Message]:
    return [await ch.recv() for _ in range(n)]


# ---- frames ------------------------------------------------------------------------------------
async def test_many_frames_both_ways_from_concurrent_senders(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    """4 sender tasks per side, frames of 0..300 KiB (many need several writes): none interleave."""
    left, right = pair
    rng = random.Random(7)
    senders, per_sender = 4, 30

    def batch(side: str, k: int) -> list[Tokens]:
        sizes = [rng.choice([0, 10, 1000, 70_000, 300_000]) for _ in range(per_sender)]
        return [
            Tokens(request_id=f"{side}{k}", tokens=[i, k], text=chr(97 + k) * size)
            for i, size in enumerate(sizes)
        ]

    async def send_all(ch: FrameChannel, msgs: list[Tokens]) -> None:
        for m in msgs:
            await ch.send(m)

    plans = {side: [batch(side, k) for k in range(senders)] for side in ("L", "R")}
    tasks = [
        asyncio.create_task(send_all(ch, msgs))
        for ch, side in ((left, "L"), (right, "R"))
        for msgs in plans[side]
    ]
    got_right, got_left = await asyncio.gather(
        _recv_n(right, senders * per_sender), _recv_n(left, senders * per_sender)
    )
    await asyncio.gather(*tasks)
    for got, side in ((got_right, "L"), (got_left, "R")):
        for k in range(senders):
            # Each sender's frames arrive whole and in its order.
            assert [m for m in got if m.request_id == f"{side}{k}"] == plans[side][k]


@pytest.mark.parametrize("max_buffer", [8 * 1024 * 1024, 64 * 1024], ids=["default", "small"])
async def test_a_frame_at_the_metadata_maximum_crosses_whole(max_buffer: int) -> None:
    """4 MiB of metadata takes many recvmsg calls; with a 64 KiB buffer, backpressure too."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = FrameChannel(a), FrameChannel(b, max_buffer=max_buffer)
    try:
        big = _tokens_at_meta_size(MAX_META_BYTES)
        assert len(encode(big)) == HEADER_SIZE + MAX_META_BYTES
        sending = asyncio.create_task(left.send(big))
        assert await right.recv() == big
        await left.send(Ping(seq=1))
        assert await right.recv() == Ping(seq=1)
        await sending
    finally:
        left.close()
        right.close()


async def test_an_oversized_header_from_the_socket_is_refused_without_its_body(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    left, right = pair
    await left.send_bytes(
        HEADER.pack(b"PDKV", PROTOCOL_VERSION, int(MsgType.PING), MAX_META_BYTES + 1, 0, 0)
    )
    with pytest.raises(ProtocolError, match="metadata segment of 4194305 bytes exceeds"):
        await right.recv()  # no body follows and the socket stays open: must not wait


# ---- file descriptors --------------------------------------------------------------------------
async def test_fds_arrive_in_order_and_refer_to_the_right_files(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    left, right = pair
    fds = [_memfd(f"region {i}".encode()) for i in range(3)]
    with tempfile.TemporaryFile() as tmp:
        tmp.write(b"temp file")
        tmp.flush()
        try:
            await left.send(Ping(seq=1), [fds[0]])
            await left.send(Ping(seq=2), [fds[1], fds[2], tmp.fileno()])
            assert await right.recv() == Ping(seq=1)
            (first,) = right.take_fds(1)
            assert await right.recv() == Ping(seq=2)
            rest = right.take_fds(3)
            got = [first, *rest]
            sent = [*fds, tmp.fileno()]
            assert all(g not in sent for g in got)  # new descriptors...
            for mine, theirs in zip(sent, got, strict=True):  # ...of the same open files
                assert os.fstat(mine).st_ino == os.fstat(theirs).st_ino
            assert [os.pread(g, 64, 0) for g in got] == [
                b"region 0",
                b"region 1",
                b"region 2",
                b"temp file",
            ]
            os.pwrite(got[0], b"REGION", 0)  # a write through the received fd is seen by the sender
            assert os.pread(fds[0], 64, 0) == b"REGION 0"
            for g in got:
                os.close(g)
        finally:
            for fd in fds:
                os.close(fd)


async def test_fds_of_a_burst_of_frames_stay_with_their_frames(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    left, right = pair
    fds = [_memfd(bytes([i]) * 8) for i in range(10)]
    try:
        for i, fd in enumerate(fds):
            await left.send(Ping(seq=i), [fd])
        for i in range(10):
            assert await right.recv() == Ping(seq=i)
            (fd,) = right.take_fds(1)
            assert os.pread(fd, 8, 0) == bytes([i]) * 8
            os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)


async def test_take_fds_when_fewer_arrived(pair: tuple[FrameChannel, FrameChannel]) -> None:
    left, right = pair
    fd = _memfd(b"one")
    try:
        await left.send(Ping(seq=1), [fd])
        await right.recv()
        with pytest.raises(
            ProtocolError, match="expected 2 file descriptors with the frame, got 1"
        ):
            right.take_fds(2)
        (got,) = right.take_fds(1)  # the failed call consumed nothing
        assert os.pread(got, 3, 0) == b"one"
        os.close(got)
        assert right.take_fds(0) == []
        with pytest.raises(
            ProtocolError, match="expected 1 file descriptors with the frame, got 0"
        ):
            right.take_fds(1)
    finally:
        os.close(fd)


async def test_close_closes_unclaimed_fds() -> None:
    before = _open_fds()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = FrameChannel(a), FrameChannel(b)
    fd = _memfd(b"x")
    await left.send(Ping(seq=1), [fd, fd])
    assert await right.recv() == Ping(seq=1)  # two fds now queued, never taken
    os.close(fd)
    left.close()
    right.close()
    assert _open_fds() == before


async def test_more_fds_than_the_limit_in_one_message_is_a_protocol_error() -> None:
    before = _open_fds()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = FrameChannel(a), FrameChannel(b)
    fd = _memfd(b"x")
    try:
        await left.send(Ping(seq=1), [fd] * (MAX_FDS_PER_MSG + 1))
        with pytest.raises(ProtocolError, match=f"more than {MAX_FDS_PER_MSG} fds"):
            # The frame itself may be delivered; the channel fails at the next read at the latest.
            for _ in range(2):
                await right.recv()
    finally:
        os.close(fd)
        left.close()
        right.close()
    assert _open_fds() == before  # the kernel dropped the extra fd, close() the queued ones


async def test_register_with_a_real_shm_region_shares_memory(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    """The REGISTER path end to end: export a pool, send descriptor + fds, open, write, read."""
    import torch

    from common.ipc.backends import backend_for
    from common.ipc.shm import shm_empty

    left, right = pair
    shm = backend_for("shm")
    pool = shm_empty((4, 8), torch.float32)
    pool.zero_()
    exported = shm.export(pool)
    try:
        reg = Register.build({"num_blocks": 4}, [exported.desc], [len(exported.fds())], [])
        await left.send(reg, exported.fds())
        got = await right.recv()
        assert isinstance(got, Register)
        (desc,) = got.descriptors()
        assert desc == exported.desc
        imported = shm.open(desc, right.take_fds(got.regions[0].num_fds))
        try:
            view = imported.to_tensor()
            view[2] = 7.0  # the importer writes, the exporter sees it: same pages
            assert pool[2].tolist() == [7.0] * 8
            assert pool.sum().item() == 7.0 * 8
            del view
        finally:
            imported.close()
    finally:
        exported.close()


# ---- EOF and close -----------------------------------------------------------------------------
async def test_eof_mid_frame_is_a_protocol_error(pair: tuple[FrameChannel, FrameChannel]) -> None:
    left, right = pair
    frame = encode(Tokens(request_id="r", tokens=[1, 2, 3]))
    await left.send_bytes(frame + frame[:-4])
    left.close()
    assert await right.recv() == Tokens(request_id="r", tokens=[1, 2, 3])
    with pytest.raises(ProtocolError, match="truncated TOKENS frame"):
        await right.recv()


async def test_eof_mid_header_is_a_protocol_error(pair: tuple[FrameChannel, FrameChannel]) -> None:
    left, right = pair
    await left.send_bytes(encode(Ping(seq=1))[:7])
    left.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match="truncated header: 7 of 20"):
        await right.recv()


async def test_clean_eof_is_connection_closed(pair: tuple[FrameChannel, FrameChannel]) -> None:
    left, right = pair
    await left.send(Ping(seq=1))
    left.close()
    assert await right.recv() == Ping(seq=1)
    for _ in range(2):  # and stays so
        with pytest.raises(ConnectionClosed):
            await right.recv()


async def test_close_is_idempotent_and_wakes_a_pending_recv(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    left, right = pair
    pending = asyncio.create_task(right.recv())
    await asyncio.sleep(0)
    assert not pending.done()
    right.close()
    right.close()
    assert right.closed and not left.closed
    with pytest.raises(ConnectionClosed):
        await pending
    with pytest.raises(ConnectionClosed):
        await right.recv()
    left.close()
    left.close()
    assert left.closed


async def test_peer_credentials_are_ours(pair: tuple[FrameChannel, FrameChannel]) -> None:
    left, right = pair
    me = (os.getpid(), os.getuid(), os.getgid())
    assert left.peer_credentials() == me
    assert right.peer_credentials() == me


async def test_connect_to_a_listening_socket(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "link.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    server.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        accepting = asyncio.create_task(loop.sock_accept(server))
        client = await connect(path)
        conn, _ = await accepting
        served = FrameChannel(conn)
        try:
            await client.send(Ping(seq=9, sent_ns=1))
            assert await served.recv() == Ping(seq=9, sent_ns=1)
            await served.send(Pong(seq=9, sent_ns=1))
            assert await client.recv() == Pong(seq=9, sent_ns=1)
            assert served.peer_credentials()[0] == os.getpid()
        finally:
            client.close()
            served.close()
    finally:
        server.close()


async def test_connect_to_nothing_raises_and_leaks_no_socket(tmp_path: object) -> None:
    before = _open_fds()
    with pytest.raises(OSError):
        await connect(os.path.join(str(tmp_path), "absent.sock"))
    assert _open_fds() == before


# ---- cancellation ------------------------------------------------------------------------------
async def test_a_cancelled_send_never_tears_the_stream() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # The receiver stops reading at 64 KiB, so a 3 MiB frame cannot leave the sender in one go.
    left, right = FrameChannel(a), FrameChannel(b, max_buffer=64 * 1024)
    try:
        big = _tokens_at_meta_size(3 * 1024 * 1024)
        sending = asyncio.create_task(left.send(big))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not sending.done()  # parked in the middle of the frame
        sending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sending

        async def drain() -> tuple[list[Message], BaseException]:
            got: list[Message] = []
            while True:
                try:
                    got.append(await right.recv())
                except (ConnectionClosed, ProtocolError) as exc:
                    return got, exc

        reading = asyncio.create_task(drain())
        try:
            await left.send(Ping(seq=42))
        except PdkvError:
            sent = False  # acceptable fix: the channel knows it is broken and says so
        else:
            sent = True
        left.close()
        got, _ = await reading
        if sent:  # send() returned normally: the peer must receive that frame intact
            assert Ping(seq=42) in got
    finally:
        left.close()
        right.close()


# ---- idle watchdog -----------------------------------------------------------------------------
async def test_watch_idle_fails_a_silent_channel_and_spares_a_talking_one():
    a, b = socket.socketpair()
    quiet, talker = FrameChannel(a), FrameChannel(b)
    try:
        watchdog = asyncio.create_task(quiet.watch_idle(0.3))
        for i in range(4):  # traffic keeps it alive past the timeout
            talker.write_nowait(encode(Ping(seq=i)))
            assert isinstance(await quiet.recv(), Ping)
            await asyncio.sleep(0.1)
        assert not watchdog.done()
        with pytest.raises(TimeoutError, match="nothing received"):
            async with asyncio.timeout(5):
                await quiet.recv()
        await watchdog
    finally:
        quiet.close()
        talker.close()


async def test_watch_idle_partial_only_spares_a_quiet_client_but_not_half_a_frame():
    a, b = socket.socketpair()
    server, client_end = FrameChannel(a), FrameChannel(b)
    try:
        watchdog = asyncio.create_task(server.watch_idle(0.2, partial_only=True))
        await asyncio.sleep(0.5)  # silent between frames: fine
        assert not watchdog.done()
        client_end.write_nowait(encode(Ping(seq=1))[:7])  # half a header, then nothing
        with pytest.raises(TimeoutError, match="the rest of a frame"):
            async with asyncio.timeout(5):
                await server.recv()
        await watchdog
    finally:
        server.close()
        client_end.close()


# ---- dispatch: frames handled in the read callback ---------------------------------------------
async def test_dispatch_delivers_buffered_then_live_frames_in_order_then_eof(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    left, right = pair
    await left.send(Ping(seq=0))
    assert await right.recv() == Ping(seq=0)  # the handshake phase reads with recv
    # frames that arrive before dispatch starts sit in the buffer; they come first
    await left.send_bytes(b"".join(encode(Ping(seq=i)) for i in (1, 2)))
    await asyncio.sleep(0.01)
    got: list[Message] = []
    task = asyncio.create_task(right.dispatch(got.append))
    await asyncio.sleep(0.01)
    big = _tokens_at_meta_size(300_000)  # several reads, so delivery waits for the whole frame
    await left.send(big)
    await left.send(Pong(seq=3))
    left.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(task, 5)
    assert got == [Ping(seq=1), Ping(seq=2), big, Pong(seq=3)]


async def test_dispatch_ends_with_what_the_handler_raised_and_stops_delivering(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    left, right = pair
    got: list[Message] = []

    def handler(msg: Message) -> None:
        got.append(msg)
        if isinstance(msg, Pong):
            raise ProtocolError("unexpected PONG")

    await left.send_bytes(b"".join(encode(m) for m in (Ping(seq=1), Pong(seq=2), Ping(seq=3))))
    with pytest.raises(ProtocolError, match="unexpected PONG"):
        await asyncio.wait_for(right.dispatch(handler), 5)
    assert got == [Ping(seq=1), Pong(seq=2)]  # nothing after the refusal


async def test_dispatch_eof_inside_a_frame_is_a_protocol_error(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    left, right = pair
    frame = encode(Ping(seq=1))
    await left.send_bytes(frame[:-3])
    left.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match="inside a frame"):
        await asyncio.wait_for(right.dispatch(lambda m: None), 5)


async def test_dispatch_ends_on_fail_and_on_close(pair: tuple[FrameChannel, FrameChannel]) -> None:
    left, right = pair
    task = asyncio.create_task(right.dispatch(lambda m: None))
    await asyncio.sleep(0)
    right.fail(TimeoutError("no heartbeat"))
    with pytest.raises(TimeoutError, match="no heartbeat"):
        await asyncio.wait_for(task, 5)
    task = asyncio.create_task(left.dispatch(lambda m: None))
    await asyncio.sleep(0)
    left.close()
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(task, 5)


async def test_dispatch_refuses_a_second_dispatcher(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    _, right = pair
    task = asyncio.create_task(right.dispatch(lambda m: None))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="already"):
        await right.dispatch(lambda m: None)
    right.close()
    with pytest.raises(ConnectionClosed):
        await task


async def test_spin_delivers_and_stops_after_its_window(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    left, right = pair
    got: list[Message] = []
    task = asyncio.create_task(right.dispatch(got.append))
    await asyncio.sleep(0)
    right.spin(0.05)
    assert right.spinning
    for i in range(20):
        await left.send(Ping(seq=i))
        await asyncio.sleep(0.001)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while right.spinning:  # the window ends by itself; the loop goes back to sleeping in epoll
        assert loop.time() < deadline
        await asyncio.sleep(0.01)
    await left.send(Ping(seq=99))  # and frames still arrive the usual way
    while len(got) < 21:
        assert loop.time() < deadline
        await asyncio.sleep(0.001)
    assert got == [Ping(seq=i) for i in (*range(20), 99)]
    right.spin(0)  # zero does nothing
    assert not right.spinning
    right.close()
    with pytest.raises(ConnectionClosed):
        await task


_CLOSE_DURING_WRITE = """
import asyncio, socket
from common.daemon import lifecycle
from common.wire.channel import FrameChannel
from common.protocol import Error, ErrorCode, Ping

async def main() -> int:
    a, b = socket.socketpair()  # b is never read: the big frame waits for the socket
    ch = FrameChannel(a)
    big = Error(code=ErrorCode.INTERNAL, message="x" * 3_000_000, request_id="r")
    task = asyncio.create_task(ch.send(big))
    await asyncio.sleep(0.1)
    assert not task.done(), "the send should be waiting for the socket"
    ch.close()
    (res,) = await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)
    print("write ended:", type(res).__name__)
    b.close()
    # the loop is still healthy, also for a socket that reuses the closed fd number
    c, d = socket.socketpair()
    left, right = FrameChannel(c), FrameChannel(d)
    await left.send(Ping(seq=7))
    print("next channel:", await asyncio.wait_for(right.recv(), 5))
    left.close(), right.close()
    return 0

raise SystemExit(lifecycle.run(main))
"""


def test_close_while_a_write_waits_fails_that_write_and_the_loop_lives_on() -> None:
    """Found in review: closing a channel whose write waited for the socket left the writer on
    the loop; uvloop then aborted the whole process (asyncio hung the sender forever)."""
    r = subprocess.run(
        [sys.executable, "-c", _CLOSE_DURING_WRITE], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "write ended: ConnectionError" in r.stdout, r.stdout
    assert "next channel: Ping(seq=7" in r.stdout, r.stdout


async def test_close_with_whole_frames_buffered_ends_dispatch_as_closed(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    """A handler that closes its channel while more frames wait: ConnectionClosed, not a
    'closed inside a frame' protocol error."""
    left, right = pair
    seen: list[Message] = []

    def handler(msg: Message) -> None:
        seen.append(msg)
        right.close()

    await left.send_bytes(b"".join(encode(Ping(seq=i)) for i in range(3)))
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(right.dispatch(handler), 5)
    assert seen == [Ping(seq=0)]


async def test_a_handler_that_raises_a_cancel_still_ends_dispatch(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    left, right = pair

    def handler(msg: Message) -> None:
        raise asyncio.CancelledError

    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    task = asyncio.create_task(right.dispatch(handler))
    await asyncio.sleep(0)
    await left.send(Ping(seq=1))
    with pytest.raises(RuntimeError, match="CancelledError"):
        await asyncio.wait_for(task, 5)


async def test_write_nowait_to_a_peer_that_never_reads_fails_the_channel_at_its_bound() -> None:
    """The decode answers with write_nowait; a peer that stops reading must not make that queue
    grow without bound: past max_queued the channel fails and its reader learns why."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ch = FrameChannel(a, max_queued=4 * 1024 * 1024)
    try:
        task = asyncio.create_task(ch.dispatch(lambda m: None))
        frame = encode(_tokens_at_meta_size(512 * 1024))
        for _ in range(64):  # 32 MiB offered; the socket takes a fraction, the rest queues
            ch.write_nowait(frame)
        with pytest.raises(ConnectionError, match="not reading"):
            await asyncio.wait_for(task, 5)
    finally:
        ch.close()
        b.close()


async def test_a_conditional_spin_lasts_while_its_condition_holds(
    pair: tuple[FrameChannel, FrameChannel],
) -> None:
    """spin(..., while_=cond): the window closes as soon as cond() turns false (not at its end),
    frames arrive meanwhile as with any spin, and a window without a condition is kept whole."""
    left, right = pair
    got: list[Message] = []
    polled: list[bool] = []  # whether each frame was read by the conditional poll

    def take(msg: Message) -> None:
        got.append(msg)
        polled.append(right.polled)

    task = asyncio.create_task(right.dispatch(take))
    await asyncio.sleep(0)
    awaited = [True]
    asked = [0]

    def cond() -> bool:
        asked[0] += 1
        return awaited[0]

    loop = asyncio.get_running_loop()
    right.spin(30, while_=cond)
    assert right.spinning
    await left.send(Ping(seq=1))
    deadline = loop.time() + 5
    while not got:
        assert loop.time() < deadline
        await asyncio.sleep(0.001)
    assert got == [Ping(seq=1)] and right.spinning and asked[0] > 0  # polled, still open
    assert polled == [True]
    awaited[0] = False
    while right.spinning:  # closes at the next poll, long before its 30 s
        assert loop.time() < deadline
        await asyncio.sleep(0.001)
    await left.send(Ping(seq=2))  # no window open: read through epoll
    while len(got) < 2:
        assert loop.time() < deadline
        await asyncio.sleep(0.001)
    assert polled == [True, False] and not right.polled
    asked[0] = 0
    right.spin(0.05)  # unconditional: the old condition is not asked again
    right.spin(30, while_=cond)  # false from the start: the 50 ms window still runs whole
    await asyncio.sleep(0.02)
    assert right.spinning
    while right.spinning:
        assert loop.time() < deadline
        await asyncio.sleep(0.005)
    assert asked[0] >= 1  # asked once the 50 ms were over, then the window closed
    right.close()
    with pytest.raises(ConnectionClosed):
        await task
