"""The weights socket's one message (docs/protocol.md, "Weights socket"): the owner's offer of an
arena, and the importer's reading of it; plus the read-only mapping of an offered memfd.

Frame: a 4-byte big-endian length (at most MAX_OFFER, checked before reading) and the JSON of
`Offer`; the fd of an fd-backed arena rides on the frame's first byte (SCM_RIGHTS). Nothing is
ever unpickled; every length is bounded.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import warnings
from pathlib import Path

import msgspec
import torch

from common.errors import IpcError
from common.ipc.base import RegionDescriptor
from common.ipc.fdpass import recv_exact_with_fds

MAX_OFFER = 64 * 1024
OFFER_VERSION = 1
_LEN = struct.Struct(">I")
SIZE = struct.Struct(">Q")  # a cuda-vmm region's handle: the allocation's size


class Offer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Owner → importer, once per connection of the weights socket."""

    version: int
    key: str
    layout: str  # WeightsLayout.digest()
    owner_pid: int
    region: RegionDescriptor


def offer_frame(offer: Offer) -> bytes:
    body = msgspec.json.encode(offer)
    return _LEN.pack(len(body)) + body


def ask(path: Path) -> tuple[Offer, list[int], socket.socket] | None:
    """The offer of whoever serves `path` (with its fds and the connection, kept open), or
    None when nobody does; IpcError for a malformed one."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(30)
    try:
        sock.connect(str(path))
    except OSError:  # no socket file, or a dead owner's (ECONNREFUSED)
        sock.close()
        return None
    try:  # a dying owner's listener may still take the connection into its backlog
        first = sock.recv(1, socket.MSG_PEEK)
    except (ConnectionResetError, TimeoutError):
        first = b""
    if not first:  # closed before it offered anything: nobody serves it any more
        sock.close()
        return None
    try:
        head, fds = recv_exact_with_fds(sock, _LEN.size, 1)
        (size,) = _LEN.unpack(head)
        if size > MAX_OFFER:
            raise IpcError(f"weights offer of {size} bytes (limit {MAX_OFFER})")
        body, more = recv_exact_with_fds(sock, size, 0) if size else (b"", [])
        offer = msgspec.json.decode(body, type=Offer)
    except (OSError, IpcError, msgspec.DecodeError) as exc:
        sock.close()
        raise IpcError(f"bad weights offer on {path}: {exc}") from exc
    sock.settimeout(None)
    return offer, fds + more, sock


def flat(kind: str, nbytes: int, handle: bytes, device_uuid: str) -> RegionDescriptor:
    """A whole arena as a region: uint8, offset 0."""
    return RegionDescriptor(
        kind=kind,
        handle=handle,
        offset=0,
        nbytes=nbytes,
        dtype="uint8",
        shape=(nbytes,),
        strides=(1,),
        device_uuid=device_uuid,
    )


def map_readonly(fd: int, desc: RegionDescriptor) -> torch.Tensor:
    """desc's bytes of memfd `fd`, mapped read-only: a write to them faults in this process
    instead of changing the owner's model. The fd stays open (the caller's)."""
    from common.ipc.shm import _check_sealed

    _check_sealed(fd)
    size = os.fstat(fd).st_size
    if size < desc.offset + desc.nbytes:
        raise IpcError(f"weights memfd holds {size} bytes, the offer needs {desc.nbytes}")
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    with warnings.catch_warnings():  # torch warns that the buffer is not writable: on purpose
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(mm, dtype=torch.uint8)
    return raw[desc.offset : desc.offset + desc.nbytes]


__all__ = [
    "MAX_OFFER",
    "OFFER_VERSION",
    "SIZE",
    "Offer",
    "ask",
    "flat",
    "map_readonly",
    "offer_frame",
]
