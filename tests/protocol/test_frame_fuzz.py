"""Property tests: random and mutated bytes never make the decoder raise anything but
ProtocolError / ConnectionClosed, never make it ask for more than the maxima, and whatever it
accepts is a valid message with a header inside the limits."""

from __future__ import annotations

import asyncio
import struct

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.errors import ProtocolError
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
    decode,
    encode,
    read_frame,
    split_frame,
)
from common.protocol.messages import BY_TYPE
from tests.support.protocol_strategies import HEADER, messages, reader_of

MAX_BODY = MAX_META_BYTES + MAX_MEM_BYTES + MAX_EVENT_BYTES
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

lengths = st.one_of(
    st.integers(0, 64),
    st.sampled_from([MAX_META_BYTES, MAX_META_BYTES + 1, MAX_MEM_BYTES, MAX_MEM_BYTES + 1]),
    st.integers(0, 2**32 - 1),
)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def plausible_frames(draw: st.DrawFn) -> bytes:
    """Mostly-valid headers over JSON objects keyed by the type's own field names (plus strays),
    so the decoder's validation runs, not only its header checks."""

    def mostly(valid: object, other: st.SearchStrategy[object]) -> object:
        return valid if draw(st.integers(0, 7)) else draw(other)

    magic = mostly(b"PDKV", st.binary(min_size=4, max_size=4))
    version = mostly(PROTOCOL_VERSION, st.integers(0, 0xFFFF))
    mtype = mostly(draw(st.sampled_from(list(MsgType))), st.integers(0, 0xFFFF))
    cls = BY_TYPE.get(mtype)  # type: ignore[call-overload]
    names = [f.name for f in msgspec.structs.fields(cls)] if cls else []
    keys = st.sampled_from([*names, "extra"]) if names else st.text(max_size=5)
    meta = draw(
        st.dictionaries(keys, json_values, max_size=len(names) + 1).map(msgspec.json.encode)
        | st.binary(max_size=100)
    )
    mem = draw(st.binary(max_size=16)) if draw(st.integers(0, 3)) == 0 else b""
    ev = draw(st.binary(max_size=16)) if draw(st.integers(0, 3)) == 0 else b""
    lens = [len(meta), len(mem), len(ev)]
    if draw(st.integers(0, 7)) == 0:  # a lying length field
        lens[draw(st.integers(0, 2))] = draw(lengths)
    return HEADER.pack(magic, version, mtype, *lens) + meta + mem + ev


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A valid frame with bits flipped, cut short, a length field changed, bytes added or removed."""
    frame = bytearray(encode(draw(messages)))
    how = draw(st.sampled_from(["flip", "truncate", "length", "insert", "delete"]))
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            frame[draw(st.integers(0, len(frame) - 1))] ^= 1 << draw(st.integers(0, 7))
    elif how == "truncate":
        del frame[draw(st.integers(0, len(frame) - 1)) :]
    elif how == "length":
        field = draw(st.integers(0, 2))
        value = draw(lengths | st.integers(0, 2 * len(frame)))
        struct.pack_into("!I", frame, 8 + 4 * field, value)
    elif how == "insert":
        pos = draw(st.integers(0, len(frame)))
        frame[pos:pos] = draw(st.binary(min_size=1, max_size=16))
    else:
        pos = draw(st.integers(0, len(frame) - 1))
        del frame[pos : pos + draw(st.integers(1, 16))]
    return bytes(frame)


class RecordingReader:
    """Wraps a StreamReader; records every size read_frame asks for and the bytes it got."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.asked: list[int] = []
        self.got: list[bytes] = []

    async def readexactly(self, n: int) -> bytes:
        self.asked.append(n)
        data = await self.reader.readexactly(n)
        self.got.append(data)
        return data


def _check_accepted(header: bytes, msg: Message) -> None:
    """What the decoder accepted is inside the limits and re-encodes to an equal message."""
    _, version, mtype, meta_len, mem_len, ev_len = HEADER.unpack(header[:HEADER_SIZE])
    assert version == PROTOCOL_VERSION and mtype == msg.TYPE
    assert meta_len <= MAX_META_BYTES and mem_len <= MAX_MEM_BYTES and ev_len <= MAX_EVENT_BYTES
    assert decode(encode(msg)) == msg


def _decode_in_memory(data: bytes) -> None:
    try:
        msg = decode(data)
    except ProtocolError as exc:
        assert str(exc)  # always says what was wrong
        return
    _check_accepted(data, msg)


async def _read_stream(data: bytes) -> list[Message]:
    rec = RecordingReader(reader_of(data))
    accepted = []
    while True:
        first = len(rec.got)
        try:
            msg = await read_frame(rec)
        except (ProtocolError, ConnectionClosed):
            break
        _check_accepted(rec.got[first], msg)
        accepted.append(msg)
    assert all(n == HEADER_SIZE or n <= MAX_BODY for n in rec.asked), rec.asked
    return accepted


def _split_buffer(data: bytes) -> list[Message]:
    """split_frame over the bytes as a read callback would see them all at once."""
    buf = bytearray(data)
    accepted = []
    while True:
        try:
            got = split_frame(buf)
        except ProtocolError as exc:
            assert str(exc)
            break
        if got is None:
            break
        msg, n = got
        _check_accepted(bytes(buf[:n]), msg)
        del buf[:n]
        accepted.append(msg)
    return accepted


def _both(data: bytes) -> None:
    _decode_in_memory(data)
    # the stream decoder and the buffer splitter accept the same frames, in the same order
    assert asyncio.run(_read_stream(data)) == _split_buffer(data)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    _both(data)


@FUZZ
@given(plausible_frames())
def test_random_bodies_under_plausible_headers(data: bytes) -> None:
    _both(data)


@FUZZ
@given(mutated_frames(), st.booleans())
def test_mutated_valid_frames(data: bytes, then_valid: bool) -> None:
    """Also with a valid frame after the mutated one, as a stream would carry it."""
    _both(data)
    if then_valid:
        asyncio.run(_read_stream(data + encode(Ping(seq=3, sent_ns=4))))
