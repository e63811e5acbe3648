"""Completion signals: a ring of interprocess CUDA events, and its CPU no-op sibling.

Protocol (exporter = prefill, importer = decode), per link:
- the exporter creates N events once and sends `handles()` in REGISTER; the importer opens them once;
- per request the exporter `acquire()`s a free slot, `record(slot, stream)`s it after its writes and
  names the slot in HANDOFF; the importer `wait(slot, stream)`s (the GPU waits, not the CPU) and
  acknowledges in RELEASE; only then does the exporter `release(slot)`.
A slot is re-recorded only after the peer's ack: cudaStreamWaitEvent binds to the event's most
recent record at the time of the call, so re-recording before the peer called it would make the
peer wait on the wrong (later, or already complete) work. LMCache had exactly this race.

Events are created and opened through common._cuda, not torch.cuda.Event(interprocess=True): the
importer must open a handle with its own device current, and torch's from_ipc_handle waited on by
another device's stream crashes (seen on two H200s; docs/architecture.md, "Why a first cross-GPU
probe hung").

On CPU there is nothing to wait for (the frame is the signal): the daemons' KVProducer creates no
ring there. `CpuEventRing` keeps the same slot bookkeeping with no-op records for library users
who want one code path; `event_ring(n, device)` and `imported_event_ring(handles, device)` pick
the sibling.
"""

from __future__ import annotations

from collections import deque

import structlog
import torch

from common.cuda import cuda_errors, device_index, ext, stream_ptr
from common.errors import IpcError

log = structlog.get_logger(__name__)

Stream = torch.cuda.Stream | int | None


def _is_cpu(device: torch.device | str | int) -> bool:
    return not isinstance(device, int) and torch.device(device).type == "cpu"


class SlotRing:
    """Exporter-side slot bookkeeping: every slot is free or in flight, acquire/release in pairs."""

    def __init__(self, n: int) -> None:
        if n <= 0:
            raise IpcError(f"an event ring needs at least one slot, got {n}")
        self._n = n
        self._free: deque[int] = deque(range(n))
        self._busy: set[int] = set()

    def __len__(self) -> int:
        return self._n

    @property
    def free_count(self) -> int:
        return len(self._free)

    def acquired(self, slot: int) -> bool:
        """Whether `slot` is in flight (acquired, not released yet)."""
        return slot in self._busy

    def acquire(self) -> int | None:
        """A free slot, now in flight; None when all are in flight (wait for an ack)."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._busy.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """The peer acknowledged its wait on `slot`: it may be recorded again."""
        if slot not in self._busy:
            raise IpcError(
                f"event slot {slot} released but not in flight (in flight: {self._busy})"
            )
        self._busy.remove(slot)
        self._free.append(slot)

    def _check_busy(self, slot: int) -> None:
        if slot not in self._busy:
            raise IpcError(f"event slot {slot} is not acquired; acquire() before record()")

    def close(self) -> None:
        """Idempotent; never raises."""


class CpuEventRing(SlotRing):
    """CPU sibling: slots are tracked, recording is a no-op (the frame itself is the signal)."""

    @classmethod
    def create(cls, n: int, device: torch.device | str | int = "cpu") -> CpuEventRing:
        return cls(n)

    def handles(self) -> list[bytes]:
        """One empty handle per slot (nothing to open on the other side)."""
        return [b""] * len(self)

    def record(self, slot: int, stream: Stream = None) -> None:
        self._check_busy(slot)


class EventRing(SlotRing):
    """N interprocess CUDA events (timing disabled) on one device, exported once per link."""

    def __init__(self, events: list[int], device: int) -> None:
        super().__init__(len(events))
        self._events = events
        self._device = device

    @classmethod
    def create(cls, n: int, device: torch.device | str | int) -> EventRing:
        """Create n events on `device` (CudaError with a hint when CUDA is unusable)."""
        index = device_index(device)
        events: list[int] = []
        try:
            with cuda_errors():
                for _ in range(n):
                    events.append(ext().event_create(index))
        except Exception:
            for ev in events:
                ext().event_destroy(ev)
            raise
        return cls(events, index)

    def handles(self) -> list[bytes]:
        """cudaIpcEventHandle bytes of each slot, in slot order (sent once, in REGISTER)."""
        with cuda_errors():
            return [bytes(ext().event_handle(ev)) for ev in self._events]

    def record(self, slot: int, stream: Stream = None) -> None:
        """Record `slot` on `stream` (default: the device's current stream) after its writes."""
        self._check_busy(slot)
        with cuda_errors():
            ext().event_record(self._events[slot], stream_ptr(stream, self._device))

    def close(self) -> None:
        """Destroy the events; idempotent, logs failures."""
        events, self._events = self._events, []
        for ev in events:
            try:
                with cuda_errors():
                    ext().event_destroy(ev)
            except Exception as exc:
                log.warning("event_destroy_failed", error=str(exc))


class ImportedEventRing:
    """Importer side: the peer's events opened once, with this process's device current."""

    def __init__(self, events: list[int], device: int | None) -> None:
        self._events = events
        self._device = device

    @classmethod
    def open(cls, handles: list[bytes], device: torch.device | str | int) -> ImportedEventRing:
        """Open every handle; a CPU device (or empty handles) gives a no-op ring."""
        if _is_cpu(device):
            return cls([0] * len(handles), None)
        index = device_index(device)
        events: list[int] = []
        with cuda_errors():
            for handle in handles:
                events.append(ext().event_open(handle, index))
        return cls(events, index)

    def __len__(self) -> int:
        return len(self._events)

    def wait(self, slot: int, stream: Stream = None) -> None:
        """Make `stream` (default: the current stream) wait on the slot's latest record.

        Ack the slot (RELEASE) only after this returns: the wait is bound at call time.
        """
        if not 0 <= slot < len(self._events):
            raise IpcError(f"event slot {slot} out of range for a ring of {len(self._events)}")
        if self._device is None:
            return
        with cuda_errors():
            ext().stream_wait_event(stream_ptr(stream, self._device), self._events[slot])

    def close(self) -> None:
        """Destroy the opened events; idempotent, logs failures."""
        events, self._events = self._events, []
        if self._device is None:
            return
        for ev in events:
            try:
                with cuda_errors():
                    ext().event_destroy(ev)
            except Exception as exc:
                log.warning("event_destroy_failed", error=str(exc))


def event_ring(n: int, device: torch.device | str | int) -> SlotRing:
    """The exporter's ring for `device`: EventRing on CUDA, CpuEventRing on CPU."""
    if _is_cpu(device):
        return CpuEventRing.create(n)
    return EventRing.create(n, device)


def imported_event_ring(
    handles: list[bytes], device: torch.device | str | int
) -> ImportedEventRing:
    """The importer's ring for `device` (a no-op one on CPU)."""
    return ImportedEventRing.open(handles, device)
