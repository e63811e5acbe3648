"""Entry points of the second processes the GPU tests spawn (importable by plain name).

Every child enables faulthandler, runs as a daemon and talks through queues the parent reads with
timeouts, so a crash shows a traceback instead of a hang.
"""

from __future__ import annotations

import faulthandler
import os
from typing import Any

import msgspec
import torch

from common.ipc.backends import backend_for
from common.ipc.base import RegionDescriptor
from common.ipc.events import EventRing, imported_event_ring

TIMEOUT = 60


def encode(desc: RegionDescriptor) -> bytes:
    return msgspec.msgpack.encode(desc)


def decode(raw: bytes) -> RegionDescriptor:
    return msgspec.msgpack.decode(raw, type=RegionDescriptor)


def read_region(raw_desc: bytes, out: Any) -> None:
    """Importer: open the region, send back (dtype, shape, bytes)."""
    faulthandler.enable()
    desc = decode(raw_desc)
    region = backend_for(desc.kind).open(desc, [])
    t = region.to_tensor()
    out.put(
        (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    )
    region.close()


def two_imports(raw_desc: bytes, out: Any) -> None:
    """Importer: open one allocation twice, close the first, read through the second."""
    faulthandler.enable()
    from common.cuda import ext

    desc = decode(raw_desc)
    backend = backend_for(desc.kind)
    first, second = backend.open(desc, []), backend.open(desc, [])
    refs_both = ext().open_count(desc.handle) if desc.kind == "cuda-raw" else -1
    first.close()
    torch.cuda.synchronize()
    refs_one = ext().open_count(desc.handle) if desc.kind == "cuda-raw" else -1
    data = second.to_tensor().view(torch.uint8).cpu().numpy().tobytes()
    second.close()
    refs_none = ext().open_count(desc.handle) if desc.kind == "cuda-raw" else -1
    out.put((refs_both, refs_one, refs_none, data))


def exporter_then_die(nbytes: int, out: Any, cmd: Any) -> None:
    """Exporter: allocate and export nbytes, wait for "die", then exit without cleanup."""
    faulthandler.enable()
    t = torch.full((nbytes,), 5, dtype=torch.uint8, device="cuda:0")
    region = backend_for("cuda-raw").export(t)
    torch.cuda.synchronize()
    out.put(encode(region.desc))
    cmd.get(timeout=TIMEOUT)
    os._exit(0)


def prefill_after_spin(
    n: int,
    final: float,
    spin_cycles: int,
    out: Any,
    cmd: Any,
    device: int = 0,
    backend: str = "cuda-raw",
) -> None:
    """Exporter: share a tensor (with `backend`) and an event ring; on "go", spin the stream,
    write `final`, record a slot and send it at once (before the GPU is done)."""
    faulthandler.enable()
    torch.cuda.set_device(device)
    t = torch.zeros(n, dtype=torch.float32, device=f"cuda:{device}")
    region = backend_for(backend).export(t)
    ring = EventRing.create(2, device)
    torch.cuda.synchronize()
    out.put((encode(region.desc), ring.handles()))
    cmd.get(timeout=TIMEOUT)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(spin_cycles)
        t.fill_(final)
    slot = ring.acquire()
    assert slot is not None
    ring.record(slot, stream)
    out.put(slot)
    cmd.get(timeout=TIMEOUT)
    ring.close()


def prefill_cycling(
    requests: int, slots: int, spin_cycles: int, early_reuse: bool, out: Any, acks: Any
) -> None:
    """Exporter: request i writes i into buffer[slot] after a GPU spin, records the slot and
    sends (i, slot). With early_reuse it releases each slot at once (the bug the ring prevents);
    otherwise it releases a slot only on the peer's ack."""
    faulthandler.enable()
    buf = torch.full((slots, 1 << 16), -1.0, device="cuda:0")
    region = backend_for("cuda-raw").export(buf)
    ring = EventRing.create(slots, 0)
    torch.cuda.synchronize()
    out.put((encode(region.desc), ring.handles()))
    stream = torch.cuda.Stream(0)
    for i in range(requests):
        slot = ring.acquire()
        while slot is None:
            ring.release(acks.get(timeout=TIMEOUT))
            slot = ring.acquire()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(spin_cycles)
            buf[slot].fill_(float(i))
        ring.record(slot, stream)
        out.put((i, slot))
        if early_reuse:
            ring.release(slot)
    out.put(None)
    acks.get(timeout=TIMEOUT)  # "done": keep the memory alive until the peer has read it
    ring.close()


def open_ring(raw_desc: bytes, handles: list[bytes], device: int) -> tuple[Any, Any]:
    desc = decode(raw_desc)
    return backend_for(desc.kind).open(desc, []), imported_event_ring(handles, device)
