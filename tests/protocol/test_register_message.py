"""REGISTER: build / descriptors / event_handle_list round trips, and segments that disagree."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.ipc.base import RegionDescriptor, contiguous_strides
from common.protocol import MsgType, Register, decode, encode
from tests.support.protocol_strategies import raw_frame, region_descriptors

LAYOUT: dict[str, int | str] = {"num_blocks": 8, "block_size": 16, "dtype": "float16"}


def _desc(
    kind: str, handle: bytes, shape: tuple[int, ...], dtype: str = "float16"
) -> RegionDescriptor:
    itemsize = {"float16": 2, "float32": 4, "uint8": 1}[dtype]
    n = 1
    for d in shape:
        n *= d
    desc = RegionDescriptor(
        kind=kind,
        handle=handle,
        offset=4096,
        nbytes=n * itemsize,
        dtype=dtype,
        shape=shape,
        strides=contiguous_strides(shape),
        device_uuid="" if kind == "shm" else "GPU-0000",
    )
    desc.check()  # a consistent descriptor, as a backend would export it
    return desc


def test_cuda_style_register_round_trips_through_a_frame() -> None:
    descs = [
        _desc("cuda-raw", bytes(range(64)), (8, 2, 2, 16, 2, 16)),
        _desc("cuda-torch", b"\xaa" * 37, (4, 4), "float32"),
    ]
    events = [bytes([i]) * 64 for i in range(5)]
    reg = Register.build(LAYOUT, descs, [0, 0], events)
    assert reg.mem_handles == bytes(range(64)) + b"\xaa" * 37
    assert [r.handle_len for r in reg.regions] == [64, 37]
    assert (reg.event_count, reg.event_handle_size) == (5, 64)

    back = decode(encode(reg))
    assert isinstance(back, Register) and back == reg
    assert back.descriptors() == descs
    assert back.event_handle_list() == events
    for d in back.descriptors():
        d.check()


def test_shm_style_register_carries_fd_counts_and_no_handle_bytes() -> None:
    descs = [_desc("shm", b"", (8, 2, 2, 16, 2, 16)), _desc("shm", b"", (3,), "uint8")]
    reg = Register.build(LAYOUT, descs, [1, 2], [])
    frame = encode(reg)
    assert frame[12:20] == bytes(8)  # both segment lengths are 0
    back = decode(frame)
    assert [r.num_fds for r in back.regions] == [1, 2]
    assert back.descriptors() == descs
    assert back.event_handle_list() == []


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    descs=st.lists(region_descriptors(), max_size=4),
    size=st.integers(0, 64),
    count=st.integers(0, 6),
    data=st.data(),
)
def test_build_descriptors_event_handles_round_trip(
    descs: list[RegionDescriptor], size: int, count: int, data: st.DataObject
) -> None:
    events = data.draw(
        st.lists(st.binary(min_size=size, max_size=size), min_size=count, max_size=count)
    )
    fd_counts = data.draw(st.lists(st.integers(0, 4), min_size=len(descs), max_size=len(descs)))
    back = decode(encode(Register.build(LAYOUT, descs, fd_counts, events)))
    assert back.descriptors() == descs
    assert back.event_handle_list() == events
    assert [r.num_fds for r in back.regions] == fd_counts


def test_build_refuses_fd_counts_of_another_length() -> None:
    descs = [_desc("shm", b"", (4,))]
    with pytest.raises(ValueError):
        Register.build(LAYOUT, descs, [1, 1], [])
    with pytest.raises(ValueError):
        Register.build(LAYOUT, descs, [], [])


def test_build_refuses_event_handles_of_different_sizes() -> None:
    with pytest.raises(ValueError, match="same size"):
        Register.build(LAYOUT, [], [], [b"a" * 64, b"b" * 63])


def _register_frame(mem: bytes, ev: bytes, *, handle_len: int, count: int, size: int) -> bytes:
    meta = (
        b'{"layout":{},"regions":[{"kind":"cuda-raw","handle_len":%d,"offset":0,"nbytes":4,'
        b'"dtype":"float32","shape":[1],"strides":[1]}],"event_count":%d,"event_handle_size":%d}'
        % (handle_len, count, size)
    )
    return raw_frame(int(MsgType.REGISTER), meta, mem, ev)


def test_a_consistent_handwritten_register_decodes() -> None:
    reg = decode(_register_frame(b"h" * 64, b"e" * 128, handle_len=64, count=2, size=64))
    assert reg.descriptors()[0].handle == b"h" * 64
    assert reg.event_handle_list() == [b"e" * 64] * 2


@pytest.mark.parametrize("mem_len", [0, 63, 65, 128])
def test_memory_segment_disagreeing_with_handle_len(mem_len: int) -> None:
    reg = decode(_register_frame(b"h" * mem_len, b"", handle_len=64, count=0, size=0))
    with pytest.raises(ValueError, match="memory-handle segment length does not match"):
        reg.descriptors()


@pytest.mark.parametrize(
    ("ev_len", "count", "size"), [(127, 2, 64), (129, 2, 64), (64, 0, 64), (0, 1, 64), (10, 3, 0)]
)
def test_event_segment_disagreeing_with_count_and_size(ev_len: int, count: int, size: int) -> None:
    reg = decode(_register_frame(b"h" * 64, b"e" * ev_len, handle_len=64, count=count, size=size))
    with pytest.raises(ValueError, match="event_count × event_handle_size"):
        reg.event_handle_list()
