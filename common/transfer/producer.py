"""The producer side of the KV transfer (the prefill's): one per process, over the daemon's pool.

Contract, in the order a request meets it:
- The pool is exported once, at construction; `register()` gives every new link the same
  REGISTER frame and the fds that travel with it (still owned here: the kernel duplicates them).
- Per request, on CUDA: `acquire_slot()` before the request's writes, `record(slot, stream)` right
  after them on the same stream; the slot is named in the HANDOFF. On CPU there is no event ring
  (the HANDOFF frame itself orders after the writes): `acquire_slot()` gives -1 and every slot verb
  ignores -1.
- `lease(rid, link_id, deadline)` when the HANDOFF goes out; the blocks are the link's to read.
- `released(rid, slot)` on the peer's RELEASE: the blocks are freed and the slot is free again.
- A slot named in a HANDOFF whose request ended without a RELEASE is `quarantine`d: the peer may
  still wait on it, and `cudaStreamWaitEvent` binds to the latest record at call time, so it is
  recorded again only after a late RELEASE (`ack_late`) or the end of the link (`link_lost`).
- `link_lost(link_id)` frees every lease of that link; `expired(now)` frees overdue leases.
- `close()` once, after the last link ended.

Block allocation (allocate/free) stays with the caller; the producer only leases what it owns.
"""

from __future__ import annotations

import structlog
import torch

from common.allocator import BlockAllocator
from common.ipc.events import EventRing
from common.kvpool import KVPool
from common.protocol import Register
from common.transfer.regions import export_region

log = structlog.get_logger(__name__)


class KVProducer:
    def __init__(
        self, pool: KVPool, allocator: BlockAllocator, backend: str, *, event_slots: int
    ) -> None:
        self.pool = pool
        self.allocator = allocator
        device = pool.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # CUDA calls from the loop thread: export, events
        self.region = export_region(pool.tensor, backend)
        self.events = EventRing.create(event_slots, device) if device.type == "cuda" else None
        self._quarantine: set[int] = set()

    @property
    def event_slots(self) -> int:
        return len(self.events) if self.events is not None else 0

    def register(self) -> tuple[Register, list[int]]:
        """The REGISTER frame for a new link and the fds to send with it."""
        fds = self.region.fds()
        handles = self.events.handles() if self.events is not None else []
        reg = Register.build(self.pool.layout.to_wire(), [self.region.desc], [len(fds)], handles)
        return reg, fds

    # ---- event slots -----------------------------------------------------------------------------
    def acquire_slot(self) -> int | None:
        """A slot to record after this request's writes: -1 without a ring, None if all busy."""
        if self.events is None:
            return -1
        return self.events.acquire()

    def record(self, slot: int, stream: object = None) -> None:
        """Record `slot` on `stream` right after the writes it covers (torch thread)."""
        if slot >= 0 and self.events is not None:
            self.events.record(slot, stream)  # type: ignore[arg-type]

    def drop_slot(self, slot: int) -> None:
        """The request ended before the peer could wait on `slot`: free it now."""
        if slot >= 0 and self.events is not None:
            self.events.release(slot)

    def quarantine(self, slot: int) -> None:
        """The request ended after its HANDOFF but before the RELEASE: keep `slot` out of use."""
        if slot >= 0:
            self._quarantine.add(slot)

    def ack_late(self, slot: int) -> bool:
        """A RELEASE arrived for a request already gone: its slot may be recorded again."""
        if slot in self._quarantine and self.events is not None:
            self._quarantine.discard(slot)
            self.events.release(slot)
            return True
        return False

    # ---- leases ----------------------------------------------------------------------------------
    def lease(self, request_id: str, link_id: str, deadline: float) -> None:
        self.allocator.lease(request_id, link_id, deadline)

    def released(self, request_id: str, slot: int) -> bool:
        """RELEASE for a live request: free its blocks and slot; False if it holds none (late)."""
        if request_id not in self.allocator:
            return False
        self.allocator.release(request_id)
        self.drop_slot(slot)
        return True

    def link_lost(self, link_id: str) -> list[str]:
        """The link ended: free its leases (returned) and every quarantined slot (the peer closed
        its event handles with the link)."""
        freed = self.allocator.release_holder(link_id) if link_id else []
        for slot in list(self._quarantine):
            self.ack_late(slot)
        return freed

    def expired(self, now: float) -> list[str]:
        """Free every lease whose deadline is <= now; their request ids, earliest first."""
        overdue = self.allocator.expired(now)
        for rid in overdue:
            self.allocator.free(rid)
        return overdue

    def close(self) -> None:
        """Idempotent; never raises."""
        self.region.close()
        if self.events is not None:
            self.events.close()


__all__ = ["KVProducer"]
