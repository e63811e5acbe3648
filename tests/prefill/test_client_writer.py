"""The prefill's ClientWriter on a real Unix socket pair: a loop turn's frames leave in one write
and in order; a client that reads nothing is timed out, one that reads slowly is not."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from common.protocol import ErrorCode, Finish, Tokens, Usage, make_error
from common.wire.channel import FrameChannel
from prefill_server.client_writer import ClientWriter


def _pair(*, rcvbuf: int | None = None) -> tuple[FrameChannel, FrameChannel]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if rcvbuf:
        for s in (a, b):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, rcvbuf)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return FrameChannel(a, max_fds=0), FrameChannel(b, max_fds=0)


async def test_frames_sent_in_one_loop_turn_leave_in_one_write_in_order() -> None:
    server, client = _pair()
    writer = ClientWriter(server, write_timeout_s=5)
    go = asyncio.Event()

    async def relay(i: int) -> None:  # as the request tasks a decode step's frames wake
        await go.wait()
        await writer.send(Tokens(request_id=f"r{i}", tokens=[i], text=chr(65 + i)))

    try:
        tasks = [asyncio.create_task(relay(i)) for i in range(20)]
        await asyncio.sleep(0)
        go.set()
        await asyncio.gather(*tasks)
        assert writer.writes == 1  # the twenty frames of one turn: one write
        await writer.send(make_error(ErrorCode.INTERNAL, "after them", "r0"))
        got = [await asyncio.wait_for(client.recv(), 5) for _ in range(21)]
        assert writer.writes == 2
        assert [m.tokens for m in got[:20]] == [[i] for i in range(20)]
        assert got[20].message == "after them"
    finally:
        server.close()
        client.close()


async def test_a_client_that_reads_nothing_times_out() -> None:
    server, client = _pair(rcvbuf=4096)
    writer = ClientWriter(server, write_timeout_s=0.3, high_water=16 * 1024)
    big = Finish(request_id="r", reason="length", usage=Usage(1, 1), text="x" * 8000)
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            for _ in range(10_000):
                await writer.send(big)
                await asyncio.sleep(0)
        assert 0.3 <= time.monotonic() - start < 5
    finally:
        server.close()
        client.close()


async def test_a_client_that_reads_slowly_is_not_timed_out() -> None:
    server, client = _pair(rcvbuf=4096)
    writer = ClientWriter(server, write_timeout_s=0.3, high_water=16 * 1024)
    frames = 120
    big = Finish(request_id="r", reason="length", usage=Usage(1, 1), text="y" * 2000)

    async def read_slowly() -> int:
        for _ in range(frames):
            await client.recv()
            await asyncio.sleep(0.01)  # 120 frames: ~1.2 s in all, far past the timeout
        return frames

    reader = asyncio.create_task(read_slowly())
    try:
        for _ in range(frames):
            await writer.send(big)  # raises if the client counted as not reading
            await asyncio.sleep(0)
        assert await asyncio.wait_for(reader, 10) == frames
    finally:
        server.close()
        client.close()


async def test_a_closed_connection_refuses_frames() -> None:
    server, client = _pair()
    writer = ClientWriter(server, write_timeout_s=1)
    server.close()
    with pytest.raises(ConnectionError):
        await writer.send(Tokens(request_id="r", tokens=[1]))
    client.close()


async def test_frames_queued_without_waiting_keep_their_place_among_sent_ones() -> None:
    server, client = _pair()
    writer = ClientWriter(server, write_timeout_s=5)
    try:
        for i in range(6):  # a read callback's send_nowait between a task's sends
            if i % 2:
                assert writer.can_send_now()
                writer.send_nowait(Tokens(request_id="r", tokens=[i]))
            else:
                await writer.send(Tokens(request_id="r", tokens=[i]))
        await asyncio.sleep(0)
        assert writer.writes == 1
        got = [await asyncio.wait_for(client.recv(), 5) for _ in range(6)]
        assert [m.tokens for m in got] == [[i] for i in range(6)]
    finally:
        server.close()
        client.close()


async def test_can_send_now_is_false_where_send_would_wait_or_time_out() -> None:
    server, client = _pair(rcvbuf=4096)
    writer = ClientWriter(server, write_timeout_s=0.3, high_water=16 * 1024)
    big = Tokens(request_id="r", tokens=[1], text="z" * 8000)
    try:
        sent = 0
        while writer.can_send_now():  # the client reads nothing (the kernel takes MBs first)
            writer.send_nowait(big)
            sent += 1
            await asyncio.sleep(0)  # the turn's flush
            assert sent < 10_000, "a client that reads nothing never counted as behind"
        assert server.queued > writer.high_water
        start = time.monotonic()
        with pytest.raises(TimeoutError):  # the frames left to a task's send: they time out
            for _ in range(10_000):
                await writer.send(big)
                await asyncio.sleep(0)
        assert time.monotonic() - start < 5
        assert not writer.can_send_now()
        server.close()
        assert not writer.can_send_now()
    finally:
        server.close()
        client.close()


async def test_can_send_now_again_once_the_client_has_read_its_backlog() -> None:
    server, client = _pair(rcvbuf=4096)
    writer = ClientWriter(server, write_timeout_s=5, high_water=16 * 1024)
    big = Tokens(request_id="r", tokens=[1], text="w" * 8000)
    try:
        sent = 0
        while writer.can_send_now():
            writer.send_nowait(big)
            sent += 1
            await asyncio.sleep(0)
        for _ in range(sent):
            await asyncio.wait_for(client.recv(), 5)
        await asyncio.sleep(0)
        assert server.queued == 0
        assert writer.can_send_now()
    finally:
        server.close()
        client.close()
