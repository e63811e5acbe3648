"""Every message of the wire protocol as a typed, validated class; one class per direction.

Metadata travels as JSON (msgspec, unknown fields refused). Fields typed `bytes` named
`mem_handles` / `event_handles` do not travel in the JSON: the frame carries them as its binary
segments (see frame.py). Directions: P = prefill daemon, D = decode daemon, C = client.
"""

from __future__ import annotations

import enum
from typing import Annotated, ClassVar, Literal

import msgspec

from common.ipc.descriptor import RegionDescriptor
from common.sampling_params import SamplingParams

NonNeg = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Nonce = Annotated[str, msgspec.Meta(max_length=128)]
Proof = Annotated[str, msgspec.Meta(max_length=128)]


class MsgType(enum.IntEnum):
    HELLO = 1
    HELLO_OK = 2
    REGISTER = 3
    REGISTERED = 4
    HANDOFF = 5
    RELEASE = 6
    TOKENS = 7
    FINISH = 8
    ABORT = 9
    ERROR = 10
    PING = 11
    PONG = 12
    PUSH = 13  # v3
    PUSH_FAILED = 14  # v3
    GENERATE = 20
    STATUS = 21
    STATUS_REPLY = 22


class ErrorCode(enum.StrEnum):
    CACHE_NOT_EXIST = "CACHE_NOT_EXIST"
    WAIT_TIMEOUT = "WAIT_TIMEOUT"
    NO_CAPACITY = "NO_CAPACITY"
    BAD_REQUEST = "BAD_REQUEST"
    PROTOCOL_ERROR = "PROTOCOL_ERROR"
    INCOMPATIBLE = "INCOMPATIBLE"
    LINK_LOST = "LINK_LOST"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    INTERNAL = "INTERNAL"
    NUMERIC_ERROR = "NUMERIC_ERROR"  # v2: this request's logits were not finite / not drawable
    AUTH_FAILED = "AUTH_FAILED"  # v3: a TCP link's key proof is missing or wrong


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every message; TYPE is its frame type."""

    TYPE: ClassVar[MsgType]


class Hello(Message, frozen=True):
    """P → D, first frame of a link. D answers HelloOk or Error(INCOMPATIBLE) and closes.

    `compat` (v2) is what the fingerprint hashes, in the clear (common.protocol.version
    .compat_fields), so a refusal can name the field that differs."""

    TYPE = MsgType.HELLO
    protocol_version: NonNeg
    fingerprint: str
    backend: str
    pid: NonNeg
    name: str = ""
    compat: dict[str, int | str] = msgspec.field(default_factory=dict)
    nonce: Nonce = ""  # v3, TCP links: the prefill's challenge (hex)


class HelloOk(Message, frozen=True):
    """D → P: fingerprints match; REGISTER may follow."""

    TYPE = MsgType.HELLO_OK
    fingerprint: str
    pid: NonNeg
    link_id: str
    nonce: Nonce = ""  # v3, TCP links: the decode's challenge (hex)
    proof: Proof = ""  # v3, TCP links: HMAC-SHA256 proving the decode holds the key (hex)


class RegionInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """RegionDescriptor less its handle bytes, which travel in the frame's memory segment."""

    kind: str
    handle_len: NonNeg
    offset: NonNeg
    nbytes: NonNeg
    dtype: str
    shape: tuple[NonNeg, ...]
    strides: tuple[NonNeg, ...]
    device_uuid: str = ""
    num_fds: NonNeg = 0


class NixlRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """v3: a pool registered with a NIXL agent, for a link across hosts (TCP).

    `metadata` is the agent's metadata (hex, for the peer's add_remote_agent); `addr`/`nbytes`
    the registered pool in the owner's address space, `device_id` its GPU (0 for DRAM).
    `transfer` is how the link moves blocks: "push" (the prefill WRITEs into the decode's
    blocks) or "pull" (the decode READs the prefill's)."""

    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    metadata: Annotated[str, msgspec.Meta(max_length=128 * 1024)]
    addr: NonNeg
    nbytes: NonNeg
    device_id: NonNeg
    mem_type: Literal["DRAM", "VRAM"]
    transfer: Literal["push", "pull"]


class Register(Message, frozen=True):
    """P → D, once per link: the prefill pool's regions and its event ring.

    For `shm` the region's fd travels with this frame (SCM_RIGHTS), `num_fds` per region. On a
    TCP link (v3) `regions` is empty and `nixl` names the pool; `proof` is the prefill's HMAC
    answering the decode's nonce (checked before anything else of the frame).
    """

    TYPE = MsgType.REGISTER
    layout: dict[str, int | str]
    regions: list[RegionInfo]
    event_count: NonNeg = 0
    event_handle_size: NonNeg = 0
    mem_handles: bytes = b""
    event_handles: bytes = b""
    nixl: NixlRegion | None = None  # v3
    proof: Proof = ""  # v3

    @classmethod
    def build(
        cls,
        layout: dict[str, int | str],
        descs: list[RegionDescriptor],
        fd_counts: list[int],
        event_handles: list[bytes],
    ) -> Register:
        size = len(event_handles[0]) if event_handles else 0
        if any(len(h) != size for h in event_handles):
            raise ValueError("event handles must all have the same size")
        regions = [
            RegionInfo(
                kind=d.kind,
                handle_len=len(d.handle),
                offset=d.offset,
                nbytes=d.nbytes,
                dtype=d.dtype,
                shape=d.shape,
                strides=d.strides,
                device_uuid=d.device_uuid,
                num_fds=n,
            )
            for d, n in zip(descs, fd_counts, strict=True)
        ]
        return cls(
            layout=layout,
            regions=regions,
            event_count=len(event_handles),
            event_handle_size=size,
            mem_handles=b"".join(d.handle for d in descs),
            event_handles=b"".join(event_handles),
        )

    def descriptors(self) -> list[RegionDescriptor]:
        """The regions with their handle bytes put back (ValueError if the segment disagrees)."""
        if sum(r.handle_len for r in self.regions) != len(self.mem_handles):
            raise ValueError("memory-handle segment length does not match the regions' handle_len")
        out, pos = [], 0
        for r in self.regions:
            handle = self.mem_handles[pos : pos + r.handle_len]
            pos += r.handle_len
            out.append(
                RegionDescriptor(
                    kind=r.kind,
                    handle=handle,
                    offset=r.offset,
                    nbytes=r.nbytes,
                    dtype=r.dtype,
                    shape=r.shape,
                    strides=r.strides,
                    device_uuid=r.device_uuid,
                )
            )
        return out

    def event_handle_list(self) -> list[bytes]:
        """The event handles, split (ValueError if the segment disagrees with count × size)."""
        size = self.event_handle_size
        if self.event_count * size != len(self.event_handles):
            raise ValueError("event-handle segment length is not event_count × event_handle_size")
        return [self.event_handles[i * size : (i + 1) * size] for i in range(self.event_count)]


class Registered(Message, frozen=True):
    """D → P: the pool is imported; HANDOFFs may follow. On a push link (v3) `nixl` names the
    decode's pool, which the prefill WRITEs into."""

    TYPE = MsgType.REGISTERED
    num_blocks: NonNeg
    nixl: NixlRegion | None = None  # v3


class Push(Message, frozen=True):
    """D → P (v3, push links): WRITE your blocks `src_ids` into my blocks `dst_ids` with NIXL and
    notify me with `tag` (the notification's bytes are `pdkv-push:<tag>`). Sent for a HANDOFF
    once the decode has allocated its blocks; the RELEASE follows the notification as usual."""

    TYPE = MsgType.PUSH
    tag: NonNeg
    src_ids: list[NonNeg]
    dst_ids: list[NonNeg]


class PushFailed(Message, frozen=True):
    """P → D (v3): the WRITE of push `tag` failed or could not start; that request fails."""

    TYPE = MsgType.PUSH_FAILED
    tag: NonNeg
    message: str


class Handoff(Message, frozen=True):
    """P → D, per request: the prompt's KV is in `block_ids` of the registered pool.

    `event_slot` is the ring slot recorded after the scatter (-1 on CPU: the frame is the signal).
    `sent_ns` is the sender's CLOCK_MONOTONIC (same host), for handoff latency.
    """

    TYPE = MsgType.HANDOFF
    request_id: RequestId
    block_ids: list[NonNeg]
    num_tokens: NonNeg
    prompt_tokens: list[TokenId]
    first_token: TokenId
    sampling: SamplingParams
    event_slot: Annotated[int, msgspec.Meta(ge=-1)] = -1
    sent_ns: NonNeg = 0


class Release(Message, frozen=True):
    """D → P: the blocks of `request_id` are copied (and event_slot waited on): free them."""

    TYPE = MsgType.RELEASE
    request_id: RequestId
    event_slot: Annotated[int, msgspec.Meta(ge=-1)] = -1


class Tokens(Message, frozen=True):
    """D → P → C: new tokens of a request, in order. `text` is filled by P for its client."""

    TYPE = MsgType.TOKENS
    request_id: RequestId
    tokens: list[TokenId]
    text: str = ""


class Usage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompt_tokens: NonNeg
    completion_tokens: NonNeg


class Finish(Message, frozen=True):
    """D → P → C: the request is done. reason: "stop" (EOS), "length" (max_tokens), "abort"."""

    TYPE = MsgType.FINISH
    request_id: RequestId
    reason: str
    usage: Usage
    timings: dict[str, float] = {}
    text: str = ""


class Abort(Message, frozen=True):
    """P → D (or C → P): stop generating `request_id`; its blocks are freed."""

    TYPE = MsgType.ABORT
    request_id: RequestId


class Error(Message, frozen=True):
    """Any direction. `request_id` None means the connection itself is at fault."""

    TYPE = MsgType.ERROR
    code: ErrorCode
    message: str
    request_id: RequestId | None = None


#: ERROR messages are cut to this many characters: an exception's text can be any size.
MAX_ERROR_TEXT = 2000


def make_error(code: ErrorCode, message: str, request_id: str | None = None) -> Error:
    """An ERROR with `message` cut to MAX_ERROR_TEXT characters."""
    if len(message) > MAX_ERROR_TEXT:
        message = message[: MAX_ERROR_TEXT - 3] + "..."
    return Error(code=code, message=message, request_id=request_id)


class Ping(Message, frozen=True):
    TYPE = MsgType.PING
    seq: NonNeg
    sent_ns: NonNeg = 0


class Pong(Message, frozen=True):
    TYPE = MsgType.PONG
    seq: NonNeg
    sent_ns: NonNeg = 0


class Generate(Message, frozen=True):
    """C → P: generate from `prompt` (text) or `prompt_tokens`; answers stream TOKENS then FINISH."""

    TYPE = MsgType.GENERATE
    sampling: SamplingParams
    prompt: str | None = None
    prompt_tokens: list[TokenId] | None = None
    request_id: RequestId | None = None
    stream: bool = True


class Status(Message, frozen=True):
    """C → P or C → D (as the first frame of a connection): answered by StatusReply."""

    TYPE = MsgType.STATUS


class StatusReply(Message, frozen=True):
    TYPE = MsgType.STATUS_REPLY
    role: str
    pid: NonNeg
    uptime_s: float
    pool: dict[str, int]
    inflight: NonNeg
    links: list[dict[str, str | int | float]] = []
    device: str = "cpu"
    backend: str = "shm"
    model: str = ""  # the model's fingerprint name (tiny-seed0-… or the checkpoint dir's name)
    dtype: str = ""
    served: NonNeg = 0  # requests finished since start
    tokens_per_s: float = 0.0  # generated tokens per second over the last minute


ALL_MESSAGES: tuple[type[Message], ...] = (
    Hello,
    HelloOk,
    Register,
    Registered,
    Handoff,
    Release,
    Tokens,
    Finish,
    Abort,
    Error,
    Ping,
    Pong,
    Push,
    PushFailed,
    Generate,
    Status,
    StatusReply,
)
BY_TYPE: dict[int, type[Message]] = {cls.TYPE: cls for cls in ALL_MESSAGES}
