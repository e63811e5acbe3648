"""The link's set-up messages, P ↔ D, before any request: HELLO / HELLO_OK (versions, fingerprints,
and on TCP links the key proofs) and REGISTER / REGISTERED (the prefill's pool: memory handles and
event ring on one host, a NIXL agent's region across hosts). Metadata travels as JSON; `bytes`
fields named `mem_handles` / `event_handles` travel as the frame's binary segments (frame.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from common.ipc.descriptor import RegionDescriptor
from common.protocol.wire_types import Message, MsgType, Nonce, NonNeg, Proof


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
    # v12: the pool block holding one int64 first token per event slot (KV_LAUNCHED); -1: none
    mailbox_block: Annotated[int, msgspec.Meta(ge=-1)] = -1

    @classmethod
    def build(
        cls,
        layout: dict[str, int | str],
        descs: list[RegionDescriptor],
        fd_counts: list[int],
        event_handles: list[bytes],
        mailbox_block: int = -1,
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
            mailbox_block=mailbox_block,
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
