"""Every message type survives encode → decode, and read_frame over a stream fed in small chunks."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.protocol import (
    HEADER_SIZE,
    MAX_EVENT_BYTES,
    MAX_MEM_BYTES,
    MAX_META_BYTES,
    PROTOCOL_VERSION,
    ConnectionClosed,
    Message,
    MsgType,
    Ping,
    Register,
    decode,
    encode,
    read_frame,
)
from common.protocol.frame import HEADER
from common.protocol.messages import BY_TYPE
from tests.support.protocol_strategies import (
    MESSAGES,
    feed_in_chunks,
    messages,
    reader_of,
    vector_script,
)


def test_every_msg_type_has_a_class_and_a_strategy() -> None:
    assert set(BY_TYPE) == set(MsgType)
    assert set(MESSAGES) == set(MsgType)
    assert all(t == cls.TYPE for t, cls in BY_TYPE.items())


@pytest.mark.parametrize("mtype", list(MsgType), ids=lambda t: t.name)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_encode_decode_round_trip_per_type(mtype: MsgType, data: st.DataObject) -> None:
    msg = data.draw(MESSAGES[mtype])
    frame = encode(msg)
    magic, version, wire_type, meta_len, mem_len, ev_len = HEADER.unpack(frame[:HEADER_SIZE])
    assert (magic, version, wire_type) == (b"PDKV", PROTOCOL_VERSION, int(mtype))
    assert len(frame) == HEADER_SIZE + meta_len + mem_len + ev_len
    assert meta_len <= MAX_META_BYTES and mem_len <= MAX_MEM_BYTES and ev_len <= MAX_EVENT_BYTES
    if isinstance(msg, Register):
        assert (mem_len, ev_len) == (len(msg.mem_handles), len(msg.event_handles))
        assert frame.endswith(msg.mem_handles + msg.event_handles)
    else:
        assert mem_len == ev_len == 0
    back = decode(frame)
    assert type(back) is type(msg)
    assert back == msg
    assert encode(back) == frame


async def _read_all(data: bytes, sizes: list[int]) -> list[Message]:
    reader = asyncio.StreamReader()
    feeder = asyncio.create_task(feed_in_chunks(reader, data, sizes))
    out: list[Message] = []
    try:
        while True:
            out.append(await read_frame(reader))
    except ConnectionClosed:
        pass
    await feeder
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    msgs=st.lists(messages, min_size=1, max_size=5),
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12),
)
def test_read_frame_over_small_chunks(msgs: list[Message], sizes: list[int]) -> None:
    """Back-to-back frames fed 1..300 bytes at a time come out whole, in order, then EOF."""
    stream = b"".join(encode(m) for m in msgs)
    assert asyncio.run(_read_all(stream, sizes)) == msgs


def test_read_frame_one_byte_at_a_time_for_every_type() -> None:
    msgs = vector_script().examples()
    stream = b"".join(encode(m) for m in msgs)
    assert asyncio.run(_read_all(stream, [1])) == msgs


async def test_read_frame_waits_for_the_rest_of_a_frame() -> None:
    """A frame split in two arrives whole once the second part is fed; nothing is lost between."""
    frame = encode(Ping(seq=5, sent_ns=6))
    reader = reader_of(frame[:7], eof=False)
    task = asyncio.create_task(read_frame(reader))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not task.done()  # 7 bytes are not a header: the reader must wait, not fail
    reader.feed_data(frame[7:] + frame)
    assert await task == Ping(seq=5, sent_ns=6)
    assert await read_frame(reader) == Ping(seq=5, sent_ns=6)


async def test_clean_eof_between_frames_is_connection_closed() -> None:
    reader = reader_of(encode(Ping(seq=1)))
    assert await read_frame(reader) == Ping(seq=1)
    with pytest.raises(ConnectionClosed, match="peer closed"):
        await read_frame(reader)
    with pytest.raises(ConnectionClosed):
        await read_frame(reader_of(b""))
