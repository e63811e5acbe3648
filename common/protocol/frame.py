"""The frame: fixed header, JSON metadata, memory-handle bytes, event-handle bytes.

Header (20 bytes, network byte order): magic b"PDKV", u16 protocol version, u16 message type,
u32 metadata length, u32 memory-handle length, u32 event-handle length. Every length is checked
against its documented maximum before a byte of the body is read or allocated.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Protocol

import msgspec

from common.errors import PdkvError, ProtocolError
from common.protocol.messages import BY_TYPE, Message, MsgType
from common.protocol.version import MAGIC, PROTOCOL_VERSION, SUPPORTED_VERSIONS

HEADER = struct.Struct("!4sHHIII")
HEADER_SIZE = HEADER.size  # 20

#: Maximum metadata length: a HANDOFF of a 64k-token prompt is about 450 KiB of JSON.
MAX_META_BYTES = 4 * 1024 * 1024
#: Maximum memory-handle segment: CUDA IPC handles are 64 bytes, a pool has a few regions.
MAX_MEM_BYTES = 64 * 1024
#: Maximum event-handle segment: 64-byte handles, up to 1024 ring slots.
MAX_EVENT_BYTES = 64 * 1024

_SEGMENT_FIELDS = ("mem_handles", "event_handles")
_ENCODER = msgspec.json.Encoder()
_DECODERS = {t: msgspec.json.Decoder(cls) for t, cls in BY_TYPE.items()}
_TYPES = {int(t): t for t in MsgType}  # a dict lookup, not an enum call, per frame
_WITH_SEGMENTS = frozenset(t for t, cls in BY_TYPE.items() if hasattr(cls, "mem_handles"))


class ConnectionClosed(PdkvError):
    """The peer closed the connection cleanly, between two frames."""


class ExactReader(Protocol):
    """What the decoder reads from: asyncio.StreamReader, or common.wire.channel.FrameChannel."""

    async def readexactly(self, n: int) -> bytes: ...


def encode(msg: Message, *, version: int = PROTOCOL_VERSION) -> bytes:
    """The whole frame of `msg`, ready to write."""
    mem = ev = b""
    if msg.TYPE in _WITH_SEGMENTS:
        mem, ev = msg.mem_handles, msg.event_handles  # type: ignore[attr-defined]
        if mem or ev:
            msg = msgspec.structs.replace(msg, mem_handles=b"", event_handles=b"")
    meta = _ENCODER.encode(msg)
    if len(meta) > MAX_META_BYTES:
        raise ProtocolError(
            f"{msg.TYPE.name} metadata of {len(meta)} bytes exceeds {MAX_META_BYTES}"
        )
    if len(mem) > MAX_MEM_BYTES or len(ev) > MAX_EVENT_BYTES:
        raise ProtocolError(
            f"{msg.TYPE.name} handle segments of {len(mem)}/{len(ev)} bytes too large"
        )
    header = HEADER.pack(MAGIC, version, msg.TYPE, len(meta), len(mem), len(ev))
    if mem or ev:
        return b"".join((header, meta, mem, ev))
    return header + meta


def parse_header(header: bytes) -> tuple[MsgType, int, int, int]:
    """Validate a header; returns (type, meta_len, mem_len, event_len). ProtocolError otherwise."""
    if len(header) != HEADER_SIZE:
        raise ProtocolError(f"truncated header: {len(header)} of {HEADER_SIZE} bytes")
    return _check_header(*HEADER.unpack(header))


def _check_header(
    magic: bytes, version: int, mtype: int, meta_len: int, mem_len: int, ev_len: int
) -> tuple[MsgType, int, int, int]:
    if magic != MAGIC:
        raise ProtocolError(f"wrong magic {magic!r}, expected {MAGIC!r}: not a pdkv peer")
    if version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            f"unsupported protocol version {version}; this build speaks {PROTOCOL_VERSION} "
            "(run the same pdkv version on both daemons)"
        )
    msg_type = _TYPES.get(mtype)
    if msg_type is None:
        raise ProtocolError(f"unknown message type {mtype}")
    if meta_len > MAX_META_BYTES or mem_len > MAX_MEM_BYTES or ev_len > MAX_EVENT_BYTES:
        for name, value, limit in (
            ("metadata", meta_len, MAX_META_BYTES),
            ("memory-handle", mem_len, MAX_MEM_BYTES),
            ("event-handle", ev_len, MAX_EVENT_BYTES),
        ):
            if value > limit:
                raise ProtocolError(f"{name} segment of {value} bytes exceeds the maximum {limit}")
    if (mem_len or ev_len) and msg_type not in _WITH_SEGMENTS:
        raise ProtocolError(
            f"{msg_type.name} carries no handle segments, header says {mem_len}/{ev_len}"
        )
    return msg_type, meta_len, mem_len, ev_len


def decode_body(
    msg_type: MsgType, meta: bytes | bytearray, mem: bytes = b"", ev: bytes = b""
) -> Message:
    """The message of one frame's body; ProtocolError naming what was wrong otherwise."""
    try:
        msg = _DECODERS[msg_type].decode(meta)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid {msg_type.name} metadata: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"{msg_type.name} metadata is not valid UTF-8 JSON: {exc}") from None
    if msg_type in _WITH_SEGMENTS:
        if msg.mem_handles or msg.event_handles:  # type: ignore[attr-defined]
            raise ProtocolError(
                f"{msg_type.name} handle bytes belong in the segments, not the JSON"
            )
        msg = msgspec.structs.replace(msg, mem_handles=mem, event_handles=ev)
    return msg


def decode(frame: bytes) -> Message:
    """Decode one whole frame held in memory (tests, vectors); trailing bytes are an error."""
    msg_type, meta_len, mem_len, ev_len = parse_header(frame[:HEADER_SIZE])
    end = HEADER_SIZE + meta_len + mem_len + ev_len
    if len(frame) != end:
        raise ProtocolError(f"frame of {len(frame)} bytes, header announces {end}")
    a = HEADER_SIZE + meta_len
    b = a + mem_len
    return decode_body(msg_type, frame[HEADER_SIZE:a], frame[a:b], frame[b:end])


def split_frame(buf: bytearray) -> tuple[Message, int] | None:
    """The first whole frame in `buf` and its length in bytes, or None while it is incomplete.

    For a reader that parses in its own data callback instead of awaiting each frame. The
    header is checked as soon as it is there, so a bad or oversized frame is refused before its
    body is waited for; ProtocolError as in read_frame."""
    if len(buf) < HEADER_SIZE:
        return None
    msg_type, meta_len, mem_len, ev_len = _check_header(*HEADER.unpack_from(buf))
    a = HEADER_SIZE + meta_len
    end = a + mem_len + ev_len
    if len(buf) < end:
        return None
    if a == end:  # no handle segments: the common case
        return decode_body(msg_type, buf[HEADER_SIZE:a]), end
    b = a + mem_len
    return decode_body(msg_type, buf[HEADER_SIZE:a], bytes(buf[a:b]), bytes(buf[b:end])), end


async def read_frame(reader: ExactReader) -> Message:
    """Read exactly one frame. ConnectionClosed on EOF between frames, ProtocolError otherwise."""
    try:
        header = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise ConnectionClosed("peer closed the connection") from None
        raise ProtocolError(
            f"truncated header: {len(exc.partial)} of {HEADER_SIZE} bytes"
        ) from None
    msg_type, meta_len, mem_len, ev_len = parse_header(header)
    try:
        body = await reader.readexactly(meta_len + mem_len + ev_len)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(
            f"truncated {msg_type.name} frame: {len(exc.partial)} of "
            f"{meta_len + mem_len + ev_len} body bytes before EOF"
        ) from None
    a, b = meta_len, meta_len + mem_len
    return decode_body(msg_type, body[:a], body[a:b], body[b:])
