"""Bad bytes always give ProtocolError naming the problem, checked before the body is read."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import PdkvError, ProtocolError
from common.protocol import (
    HEADER_SIZE,
    MAX_EVENT_BYTES,
    MAX_MEM_BYTES,
    MAX_META_BYTES,
    PROTOCOL_VERSION,
    ConnectionClosed,
    MsgType,
    Ping,
    Register,
    Tokens,
    decode,
    encode,
    read_frame,
)
from tests.support.protocol_strategies import header, raw_frame, read_one, reader_of

PING = int(MsgType.PING)
REGISTER = int(MsgType.REGISTER)
HANDOFF_OK = (
    b'{"request_id":"r","block_ids":[0],"num_tokens":1,"prompt_tokens":[1],"first_token":2,'
    b'"sampling":{}}'
)


def _decode_both(frame: bytes) -> ProtocolError:
    """Decode `frame` in memory and through read_frame; both must raise the same ProtocolError."""
    with pytest.raises(ProtocolError) as in_memory:
        decode(frame)
    with pytest.raises(ProtocolError) as streamed:
        read_one(frame)
    assert str(in_memory.value) == str(streamed.value)
    return in_memory.value


def test_connection_closed_and_protocol_error_are_distinct_pdkv_errors() -> None:
    assert issubclass(ProtocolError, PdkvError) and issubclass(ConnectionClosed, PdkvError)
    assert not issubclass(ConnectionClosed, ProtocolError)
    assert not issubclass(ProtocolError, ConnectionClosed)


# ---- header ------------------------------------------------------------------------------------
@pytest.mark.parametrize("magic", [b"PDKW", b"\x00\x00\x00\x00", b"GET ", b"pdkv"])
def test_wrong_magic(magic: bytes) -> None:
    err = _decode_both(raw_frame(PING, b'{"seq":1}', magic=magic))
    assert "wrong magic" in str(err) and "not a pdkv peer" in str(err)


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 0xFFFF])
def test_unknown_version(version: int) -> None:
    err = _decode_both(raw_frame(PING, b'{"seq":1}', version=version))
    assert f"unsupported protocol version {version}" in str(err)
    assert "same pdkv version" in str(err)


def test_encode_with_another_version_is_refused_by_the_reader() -> None:
    frame = encode(Ping(seq=1), version=PROTOCOL_VERSION + 1)
    assert "unsupported protocol version" in str(_decode_both(frame))


@pytest.mark.parametrize("mtype", [0, 18, 19, 23, 0xFFFF])
def test_unknown_type(mtype: int) -> None:
    assert f"unknown message type {mtype}" in str(_decode_both(raw_frame(mtype, b"{}")))


OVERSIZE = [
    pytest.param(PING, (MAX_META_BYTES + 1, 0, 0), "metadata", id="meta+1"),
    pytest.param(PING, (0xFFFFFFFF, 0, 0), "metadata", id="meta-u32max"),
    pytest.param(REGISTER, (10, MAX_MEM_BYTES + 1, 0), "memory-handle", id="mem+1"),
    pytest.param(REGISTER, (10, 0xFFFFFFFF, 0), "memory-handle", id="mem-u32max"),
    pytest.param(REGISTER, (10, 0, MAX_EVENT_BYTES + 1), "event-handle", id="event+1"),
    pytest.param(REGISTER, (10, 0, 0xFFFFFFFF), "event-handle", id="event-u32max"),
    pytest.param(PING, (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), "metadata", id="all-u32max"),
]


@pytest.mark.parametrize(("mtype", "lens", "segment"), OVERSIZE)
async def test_oversized_segment_is_refused_from_the_header_alone(
    mtype: int, lens: tuple[int, int, int], segment: str
) -> None:
    """Only the header is available and no EOF: the reader must fail without waiting for a body."""
    reader = reader_of(header(mtype, *lens), eof=False)
    task = asyncio.create_task(read_frame(reader))
    for _ in range(3):
        await asyncio.sleep(0)
    assert task.done(), "read_frame waited for the body of an oversized frame"
    with pytest.raises(ProtocolError, match=f"{segment} segment of \\d+ bytes exceeds the maximum"):
        task.result()


@pytest.mark.parametrize(("mtype", "lens", "segment"), OVERSIZE)
def test_oversized_segment_in_memory(mtype: int, lens: tuple[int, int, int], segment: str) -> None:
    with pytest.raises(ProtocolError, match=f"{segment} segment"):
        decode(header(mtype, *lens) + b"{}")


def test_segments_exactly_at_the_maxima_pass_the_header_check() -> None:
    """The limits are inclusive: the body is then read (here it is missing, hence 'truncated')."""
    frame = header(REGISTER, MAX_META_BYTES, MAX_MEM_BYTES, MAX_EVENT_BYTES)
    with pytest.raises(ProtocolError, match="truncated REGISTER frame: 0 of"):
        read_one(frame)


@pytest.mark.parametrize(("mem", "ev"), [(3, 0), (0, 3), (1, 1)])
@pytest.mark.parametrize("mtype", [m for m in MsgType if m is not MsgType.REGISTER])
def test_segments_on_a_type_that_has_none(mtype: MsgType, mem: int, ev: int) -> None:
    frame = raw_frame(int(mtype), b"{}", b"m" * mem, b"e" * ev)
    err = _decode_both(frame)
    assert f"{mtype.name} carries no handle segments, header says {mem}/{ev}" in str(err)


# ---- truncation and EOF ------------------------------------------------------------------------
@pytest.mark.parametrize("cut", [1, 4, 19])
def test_truncated_header(cut: int) -> None:
    frame = encode(Ping(seq=1))[:cut]
    with pytest.raises(ProtocolError, match=f"truncated header: {cut} of {HEADER_SIZE}"):
        decode(frame)
    with pytest.raises(ProtocolError, match=f"truncated header: {cut} of {HEADER_SIZE}"):
        read_one(frame)


@pytest.mark.parametrize("missing", [1, 5])
def test_truncated_body(missing: int) -> None:
    frame = encode(Ping(seq=1))
    body = len(frame) - HEADER_SIZE
    with pytest.raises(ProtocolError, match=f"truncated PING frame: {body - missing} of {body}"):
        read_one(frame[:-missing])
    with pytest.raises(ProtocolError, match=f"header announces {len(frame)}"):
        decode(frame[:-missing])


def test_trailing_bytes_after_a_frame_are_refused_in_memory() -> None:
    frame = encode(Ping(seq=1))
    with pytest.raises(ProtocolError, match=f"frame of {len(frame) + 1} bytes, header announces"):
        decode(frame + b"\x00")


def test_empty_input() -> None:
    with pytest.raises(ProtocolError, match="truncated header: 0 of 20"):
        decode(b"")
    with pytest.raises(ConnectionClosed):
        read_one(b"")


# ---- metadata ----------------------------------------------------------------------------------
def _meta_error(mtype: MsgType, meta: bytes) -> str:
    return str(_decode_both(raw_frame(int(mtype), meta)))


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        (b'{"request_id":"\xff\xfe"}', "not valid UTF-8 JSON"),
        (b'{"request_id":"ab\xc3"}', "not valid UTF-8 JSON"),
        (b'{"request_id":', "not valid UTF-8 JSON"),
        (b'{"request_id":"r",}', "not valid UTF-8 JSON"),
        (b"", "not valid UTF-8 JSON"),
        (b'{"request_id":"r"} x', "not valid UTF-8 JSON"),
        (b"\xef\xbb\xbf{}", "not valid UTF-8 JSON"),
        (b"[]", "Expected `object`, got `array`"),
        (b"null", "Expected `object`, got `null`"),
    ],
    ids=[
        "bad-utf8",
        "cut-utf8",
        "cut-json",
        "trailing-comma",
        "empty",
        "trailing",
        "bom",
        "array",
        "null",
    ],
)
def test_invalid_utf8_or_json(meta: bytes, expected: str) -> None:
    err = _meta_error(MsgType.ABORT, meta)
    assert (
        err.startswith("ABORT metadata is not valid UTF-8 JSON") or "invalid ABORT metadata" in err
    )
    assert expected in err


CASES = [
    # (type, metadata, what the message must say)
    (MsgType.PING, b"{}", "missing required field `seq`"),
    (MsgType.HANDOFF, b'{"request_id":"r"}', "missing required field"),
    (MsgType.PING, b'{"seq":1,"extra":2}', "unknown field `extra`"),
    (MsgType.STATUS, b'{"verbose":true}', "unknown field `verbose`"),
    (MsgType.PING, b'{"seq":"1"}', "Expected `int`, got `str` - at `$.seq`"),
    (MsgType.PING, b'{"seq":1.0}', "Expected `int`, got `float` - at `$.seq`"),
    (MsgType.PING, b'{"seq":true}', "Expected `int`, got `bool` - at `$.seq`"),
    (MsgType.PING, b'{"seq":null}', "Expected `int`, got `null` - at `$.seq`"),
    (MsgType.PING, b'{"seq":-1}', "Expected `int` >= 0 - at `$.seq`"),
    (MsgType.REGISTERED, b'{"num_blocks":-5}', "Expected `int` >= 0 - at `$.num_blocks`"),
    (MsgType.ABORT, b'{"request_id":""}', "Expected `str` of length >= 1 - at `$.request_id`"),
    (
        MsgType.ABORT,
        b'{"request_id":"' + b"r" * 129 + b'"}',
        "Expected `str` of length <= 128 - at `$.request_id`",
    ),
    (MsgType.RELEASE, b'{"request_id":"r","event_slot":-2}', "Expected `int` >= -1"),
    (MsgType.TOKENS, b'{"request_id":"r","tokens":[1,-1]}', "at `$.tokens[1]`"),
    (
        MsgType.TOKENS,
        b'{"request_id":"r","tokens":[2147483648]}',
        "Expected `int` <= 2147483647 - at `$.tokens[0]`",
    ),
    (MsgType.TOKENS, b'{"request_id":"r","tokens":7}', "Expected `array`, got `int`"),
    (MsgType.ERROR, b'{"code":"OOPS","message":"m"}', "Invalid enum value 'OOPS' - at `$.code`"),
    (MsgType.HANDOFF, HANDOFF_OK.replace(b"[0]", b"[-3]"), "at `$.block_ids[0]`"),
    (MsgType.HANDOFF, HANDOFF_OK.replace(b"{}", b'{"top_k":"5"}'), "at `$.sampling.top_k`"),
    (MsgType.HANDOFF, HANDOFF_OK.replace(b"{}", b'{"beam":2}'), "unknown field `beam`"),
    (
        MsgType.FINISH,
        b'{"request_id":"r","reason":"stop","usage":{"prompt_tokens":1}}',
        "`completion_tokens`",
    ),
    (MsgType.PING, b'{"seq":1' + b"0" * 5000 + b"}", "Integer value out of range"),
    (
        MsgType.STATUS_REPLY,
        b'{"role":"d","pid":1,"uptime_s":1e999,"pool":{},"inflight":0}',
        "out of range",
    ),
]


@pytest.mark.parametrize(("mtype", "meta", "expected"), CASES, ids=[c[2][:40] for c in CASES])
def test_invalid_metadata_names_the_field(mtype: MsgType, meta: bytes, expected: str) -> None:
    err = _meta_error(mtype, meta)
    assert err.startswith(f"invalid {mtype.name} metadata: "), err
    assert expected in err


def test_a_valid_handwritten_handoff_decodes() -> None:
    """The base of the HANDOFF cases above is itself valid, so each case tests one defect."""
    msg = decode(raw_frame(int(MsgType.HANDOFF), HANDOFF_OK))
    assert msg.TYPE is MsgType.HANDOFF and msg.block_ids == [0]


@pytest.mark.parametrize(
    "fields",
    [
        b'"mem_handles":"AAE="',
        b'"event_handles":"AAE="',
        b'"mem_handles":"AAE=","event_handles":"AA=="',
    ],
)
def test_handle_bytes_in_the_json_are_refused(fields: bytes) -> None:
    meta = b'{"layout":{},"regions":[],' + fields + b"}"
    err = _meta_error(MsgType.REGISTER, meta)
    assert "REGISTER handle bytes belong in the segments, not the JSON" in err


def test_handle_fields_must_be_base64_strings_in_the_json() -> None:
    err = _meta_error(MsgType.REGISTER, b'{"layout":{},"regions":[],"mem_handles":"@@"}')
    assert "invalid REGISTER metadata" in err and "$.mem_handles" in err


# ---- encoder side ------------------------------------------------------------------------------
def test_encode_refuses_metadata_over_the_maximum() -> None:
    with pytest.raises(
        ProtocolError, match=f"TOKENS metadata of \\d+ bytes exceeds {MAX_META_BYTES}"
    ):
        encode(Tokens(request_id="r", tokens=[], text="x" * MAX_META_BYTES))


@pytest.mark.parametrize(
    ("mem", "ev"), [(MAX_MEM_BYTES + 1, 0), (0, MAX_EVENT_BYTES + 1)], ids=["mem", "event"]
)
def test_encode_refuses_handle_segments_over_the_maximum(mem: int, ev: int) -> None:
    msg = Register(layout={}, regions=[], mem_handles=b"m" * mem, event_handles=b"e" * ev)
    with pytest.raises(
        ProtocolError, match=f"REGISTER handle segments of {mem}/{ev} bytes too large"
    ):
        encode(msg)


def test_encode_at_the_metadata_maximum_round_trips() -> None:
    empty = len(encode(Tokens(request_id="r", tokens=[], text=""))) - HEADER_SIZE
    msg = Tokens(request_id="r", tokens=[], text="x" * (MAX_META_BYTES - empty))
    frame = encode(msg)
    assert len(frame) == HEADER_SIZE + MAX_META_BYTES
    assert decode(frame) == msg


@pytest.mark.parametrize("rid", [b'""', b'"' + b"r" * 129 + b'"'], ids=["empty", "129-chars"])
def test_error_request_id_is_bounded_like_every_request_id(rid: bytes) -> None:
    err = _meta_error(
        MsgType.ERROR, b'{"code":"NO_CAPACITY","message":"m","request_id":' + rid + b"}"
    )
    assert "$.request_id" in err


def test_error_request_id_may_be_null() -> None:
    msg = decode(
        raw_frame(int(MsgType.ERROR), b'{"code":"LINK_LOST","message":"m","request_id":null}')
    )
    assert msg.request_id is None


def test_make_error_cuts_any_exception_text_to_a_bounded_frame() -> None:
    from common.protocol import ErrorCode, MsgType, make_error
    from common.protocol.messages import MAX_ERROR_TEXT

    err = make_error(ErrorCode.INTERNAL, "x" * 10_000_000, "r1")
    assert len(err.message) == MAX_ERROR_TEXT and err.message.endswith("...")
    assert err.request_id == "r1"
    assert decode(encode(err)) == err and err.TYPE == MsgType.ERROR
    short = make_error(ErrorCode.BAD_REQUEST, "fine")
    assert short.message == "fine" and short.request_id is None
