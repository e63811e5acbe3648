"""Hypothesis strategies that build valid protocol messages of every type, with bounded sizes.

"Valid" means: every field inside the range its type declares, so encode → decode must give the
message back. Sizes are bounded (lists ≤ 40 items, strings ≤ 40 characters) to keep examples fast.
"""

from __future__ import annotations

import asyncio
import importlib.util
import struct
import sys
from pathlib import Path
from types import ModuleType

from hypothesis import strategies as st

from common.ipc.base import RegionDescriptor
from common.model.sampling import SamplingParams
from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    ErrorCode,
    Finish,
    Generate,
    Handoff,
    Hello,
    HelloOk,
    KvLaunched,
    KvReady,
    Message,
    MsgType,
    NixlRegion,
    Ping,
    Pong,
    Push,
    PushFailed,
    Register,
    Registered,
    Release,
    Status,
    StatusReply,
    StepTokens,
    Tokens,
    Usage,
    read_frame,
)
from common.sampling_params import TokenLogprob

HEADER = struct.Struct("!4sHHIII")
ROOT = Path(__file__).resolve().parents[2]

nonneg = st.integers(min_value=0, max_value=2**63 - 1)
nixl_regions = st.builds(
    NixlRegion,
    agent=st.text(min_size=1, max_size=40),
    metadata=st.binary(max_size=64).map(bytes.hex),
    addr=nonneg,
    nbytes=nonneg,
    device_id=st.integers(0, 7),
    mem_type=st.sampled_from(["DRAM", "VRAM"]),
    transfer=st.sampled_from(["push", "pull"]),
)
small_nonneg = st.integers(min_value=0, max_value=10_000)
token_ids = st.integers(min_value=0, max_value=2**31 - 1)
request_ids = st.text(min_size=1, max_size=128)
texts = st.text(max_size=40)
finite = st.floats(allow_nan=False, allow_infinity=False)
event_slots = st.integers(min_value=-1, max_value=1023)
token_lists = st.lists(token_ids, max_size=40)

sampling_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 4096),
    temperature=st.floats(0.0, 2.0),
    top_k=st.integers(0, 200),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    seed=st.none() | nonneg,
    ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20),
    prompt_logprobs=st.none() | st.integers(0, 20),
    presence_penalty=st.floats(-2.0, 2.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    repetition_penalty=st.floats(0.0, 4.0, exclude_min=True),
    min_tokens=st.integers(0, 64),
    stop_token_ids=st.lists(token_ids, max_size=8).map(tuple),
)


logprob_entries = st.builds(
    TokenLogprob,
    token_ids,
    finite,
    st.lists(st.tuples(token_ids, finite), max_size=20),
)
finishes = st.builds(
    Finish,
    request_id=request_ids,
    reason=st.sampled_from(["stop", "length", "abort"]),
    usage=st.builds(Usage, prompt_tokens=small_nonneg, completion_tokens=small_nonneg),
    timings=st.dictionaries(texts, finite, max_size=5),
    text=texts,
)


@st.composite
def tokens_messages(draw: st.DrawFn) -> Tokens:
    """TOKENS with or without one logprob entry per token, and prompt logprobs."""
    tokens = draw(token_lists)
    n = len(tokens)
    logprobs = draw(st.none() | st.lists(logprob_entries, min_size=n, max_size=n))
    prompt = draw(st.none() | st.lists(logprob_entries, max_size=8))
    return Tokens(
        request_id=draw(request_ids),
        tokens=tokens,
        text=draw(texts),
        logprobs=logprobs,
        prompt_logprobs=prompt,
    )


@st.composite
def step_tokens_messages(draw: st.DrawFn) -> StepTokens:
    """STEP_TOKENS: one token per request id, logprobs for none, some or all, FINISHes."""
    ids = draw(st.lists(request_ids, max_size=12))
    tokens = draw(st.lists(token_ids, min_size=len(ids), max_size=len(ids)))
    some = st.lists(st.none() | logprob_entries, min_size=len(ids), max_size=len(ids))
    return StepTokens(
        request_ids=ids,
        tokens=tokens,
        logprobs=draw(st.none() | some),
        finishes=draw(st.lists(finishes, max_size=3)),
    )


@st.composite
def region_descriptors(draw: st.DrawFn) -> RegionDescriptor:
    """A real RegionDescriptor: a contiguous shape, an opaque handle of 0..80 bytes."""
    shape = tuple(draw(st.lists(st.integers(0, 64), min_size=1, max_size=4)))
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(dim, 1)
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16", "uint8"]))
    return RegionDescriptor(
        kind=draw(st.sampled_from(["shm", "cuda-raw", "cuda-torch"])),
        handle=draw(st.binary(max_size=80)),
        offset=draw(small_nonneg),
        nbytes=draw(nonneg),
        dtype=dtype,
        shape=shape,
        strides=tuple(reversed(strides)),
        device_uuid=draw(texts),
    )


@st.composite
def registers(draw: st.DrawFn) -> Register:
    """A REGISTER built from real descriptors and an event ring of equal-size handles."""
    descs = draw(st.lists(region_descriptors(), max_size=3))
    fd_counts = draw(st.lists(st.integers(0, 3), min_size=len(descs), max_size=len(descs)))
    size = draw(st.integers(0, 64))
    events = draw(st.lists(st.binary(min_size=size, max_size=size), max_size=4))
    layout = draw(st.dictionaries(texts, small_nonneg | texts, max_size=6))
    mailbox = draw(st.integers(min_value=-1, max_value=1 << 20))
    return Register.build(layout, descs, fd_counts, events, mailbox)


link_values = st.one_of(texts, st.integers(-(2**63), 2**63 - 1), finite)

MESSAGES: dict[MsgType, st.SearchStrategy[Message]] = {
    MsgType.HELLO: st.builds(
        Hello, protocol_version=nonneg, fingerprint=texts, backend=texts, pid=nonneg, name=texts
    ),
    MsgType.HELLO_OK: st.builds(HelloOk, fingerprint=texts, pid=nonneg, link_id=texts),
    MsgType.REGISTER: registers(),
    MsgType.REGISTERED: st.builds(Registered, num_blocks=nonneg, nixl=st.none() | nixl_regions),
    MsgType.HANDOFF: st.builds(
        Handoff,
        request_id=request_ids,
        block_ids=st.lists(small_nonneg, max_size=40),
        num_tokens=small_nonneg,
        prompt_tokens=token_lists,
        first_token=token_ids,
        sampling=sampling_params,
        event_slot=event_slots,
        sent_ns=nonneg,
    ),
    MsgType.KV_LAUNCHED: st.builds(KvLaunched, request_id=request_ids, sent_ns=nonneg),
    MsgType.KV_READY: st.builds(
        KvReady, request_id=request_ids, first_token=token_ids, sent_ns=nonneg
    ),
    MsgType.RELEASE: st.builds(Release, request_id=request_ids, event_slot=event_slots),
    MsgType.TOKENS: tokens_messages(),
    MsgType.FINISH: finishes,
    MsgType.STEP_TOKENS: step_tokens_messages(),
    MsgType.ABORT: st.builds(Abort, request_id=request_ids),
    MsgType.ERROR: st.builds(
        Error,
        code=st.sampled_from(ErrorCode),
        message=texts,
        request_id=st.none() | request_ids,
    ),
    MsgType.PING: st.builds(Ping, seq=nonneg, sent_ns=nonneg),
    MsgType.PONG: st.builds(Pong, seq=nonneg, sent_ns=nonneg),
    MsgType.PUSH: st.builds(
        Push, tag=nonneg, src_ids=st.lists(nonneg, max_size=8), dst_ids=st.lists(nonneg, max_size=8)
    ),
    MsgType.PUSH_FAILED: st.builds(PushFailed, tag=nonneg, message=texts),
    MsgType.GENERATE: st.builds(
        Generate,
        sampling=sampling_params,
        prompt=st.none() | texts,
        prompt_tokens=st.none() | token_lists,
        request_id=st.none() | request_ids,
        stream=st.booleans(),
    ),
    MsgType.STATUS: st.just(Status()),
    MsgType.STATUS_REPLY: st.builds(
        StatusReply,
        role=st.sampled_from(["prefill", "decode"]),
        pid=nonneg,
        uptime_s=finite,
        pool=st.dictionaries(texts, st.integers(-(2**63), 2**63 - 1), max_size=5),
        inflight=small_nonneg,
        links=st.lists(st.dictionaries(texts, link_values, max_size=4), max_size=3),
        device=texts,
        backend=texts,
    ),
}

#: Any valid message.
messages = st.one_of(*MESSAGES.values())


def header(
    mtype: int,
    meta_len: int,
    mem_len: int = 0,
    ev_len: int = 0,
    *,
    version: int = PROTOCOL_VERSION,
    magic: bytes = b"PDKV",
) -> bytes:
    """A 20-byte frame header with any field values (valid or not)."""
    return HEADER.pack(magic, version, mtype, meta_len, mem_len, ev_len)


def raw_frame(mtype: int, meta: bytes, mem: bytes = b"", ev: bytes = b"", **kw: object) -> bytes:
    """A frame with consistent lengths around arbitrary metadata and segment bytes."""
    return header(mtype, len(meta), len(mem), len(ev), **kw) + meta + mem + ev  # type: ignore[arg-type]


def reader_of(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    """A StreamReader already holding `data` (and EOF after it unless eof=False).

    Call it with a loop running: outside one, StreamReader() would create (and leak) a loop.
    """
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def read_one(data: bytes) -> Message:
    """read_frame over a StreamReader holding `data` then EOF, in a fresh event loop."""

    async def read() -> Message:
        return await read_frame(reader_of(data))

    return asyncio.run(read())


async def feed_in_chunks(reader: asyncio.StreamReader, data: bytes, sizes: list[int]) -> None:
    """Feed `data` in chunks of the given sizes (cycled), yielding to the loop after each, then EOF."""
    pos, i = 0, 0
    while pos < len(data):
        size = sizes[i % len(sizes)]
        reader.feed_data(data[pos : pos + size])
        pos, i = pos + size, i + 1
        await asyncio.sleep(0)
    reader.feed_eof()


def vector_script() -> ModuleType:
    """scripts/gen_protocol_vectors.py as a module (scripts/ is not a package)."""
    name = "gen_protocol_vectors"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
