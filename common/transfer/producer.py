"""The IPC producer (the prefill's side of a Unix-socket link): one per process, over the pool.

`KVProducer` is `interface.Producer` for peers on this host:
- The pool is exported once, at construction; `register()` gives every new link the same
  REGISTER frame and the fds that travel with it (still owned here: the kernel duplicates them).
- On CUDA it owns the event ring: `acquire_slot()` before a request's writes, `record(slot,
  stream)` right after them on the same stream; the slot is named in the HANDOFF. On CPU there
  is no ring (the HANDOFF frame itself orders after the writes): every slot is -1, ignored.
- With `mailbox` (CUDA, v12) one block of the pool, reserved from the allocator for the daemon's
  life (it leaves the allocator's total), holds one int64 per event slot (`self.mailbox`): the forward writes a plain greedy
  request's first token there before it records the slot, and REGISTER names the block, so a
  decode sent KV_LAUNCHED reads the token on its GPU behind the slot (docs/protocol.md).
- A slot named in a HANDOFF whose request ended without a RELEASE is `quarantine`d: the peer may
  still wait on it, and `cudaStreamWaitEvent` binds to the latest record at call time, so it is
  recorded again only after a late RELEASE (`ack_late`) or the end of its link (`link_lost`:
  only that link's; another decode may still wait on a slot quarantined for its request).

Block allocation (allocate/free) stays with the caller; the producer only leases what it owns.
"""

from __future__ import annotations

import structlog
import torch

from common.errors import IpcError
from common.ipc.events import EventRing
from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool
from common.protocol import Register
from common.transfer.interface import Producer
from common.transfer.regions import export_region

log = structlog.get_logger(__name__)


class KVProducer(Producer):
    """`interface.Producer` over a pool exported to peers on this host (module docstring)."""

    def __init__(
        self,
        pool: KVPool,
        allocator: BlockAllocator,
        backend: str | None,
        *,
        event_slots: int,
        mailbox: bool = False,
    ) -> None:
        super().__init__(pool, allocator)
        device = pool.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # CUDA calls from the loop thread: export, events
        self.region = export_region(pool.tensor, backend)
        self.events = EventRing.create(event_slots, device) if device.type == "cuda" else None
        # slot -> (the ended request its peer may wait for, the link it went out on)
        self._quarantine: dict[int, tuple[str, str]] = {}
        self.mailbox_block = -1
        if mailbox and self.events is not None:
            self._take_mailbox(len(self.events))

    def _take_mailbox(self, slots: int) -> None:
        """One pool block of our own for the daemon's life, as `slots` int64 entries (a block
        too small for them: no mailbox, logged; that block stays out of use)."""
        block = self.allocator.reserve()  # out of the counters: status shows what requests hold
        try:
            self.mailbox = self.pool.words(block, slots)
        except IpcError as exc:
            log.warning("no_first_token_mailbox", error=str(exc), event_slots=slots)
            return
        self.mailbox_block = block

    def register(self) -> tuple[Register, list[int]]:
        fds = self.region.fds()
        handles = self.events.handles() if self.events is not None else []
        layout = self.pool.layout.to_wire()
        reg = Register.build(layout, [self.region.desc], [len(fds)], handles, self.mailbox_block)
        return reg, fds

    # ---- event slots -----------------------------------------------------------------------------
    @property
    def event_slots(self) -> int:
        return len(self.events) if self.events is not None else 0

    def acquire_slot(self) -> int | None:
        """A slot to record after this request's writes: -1 without a ring, None if all busy."""
        if self.events is None:
            return -1
        return self.events.acquire()

    def record(self, slot: int, stream: object = None) -> None:
        """Record `slot` on `stream` right after the writes it covers (torch thread). A slot let
        go of while its forward ran (the request ended, no decode could wait on it yet:
        `drop_slot`) is skipped, and its batch goes on: recording it would fail the batch, and
        once a later request holds it again, this record comes before that request's own
        (one torch thread, one stream), which its decode waits on, so it is harmless too."""
        if slot >= 0 and self.events is not None:
            if not self.events.acquired(slot):
                log.debug("event_slot_dropped_before_record", slot=slot)
                return
            self.events.record(slot, stream)  # type: ignore[arg-type]

    def drop_slot(self, slot: int) -> None:
        """The request ended before the peer could wait on `slot`: free it now."""
        if slot >= 0 and self.events is not None:
            self.events.release(slot)

    def quarantine(self, slot: int, request_id: str, link_id: str) -> None:
        """`request_id`, handed off on `link_id`, ended after its HANDOFF but before the
        RELEASE: keep `slot` out of use until the peer answers for that request or that link
        ends."""
        if slot >= 0:
            self._quarantine[slot] = (request_id, link_id)

    def ack_late(self, slot: int, request_id: str) -> bool:
        """The peer's late RELEASE (or answer to the ABORT) for `request_id`: the slot
        quarantined for it may be recorded again. One for another request frees nothing: a
        stale RELEASE of a request whose slot was freed and taken since (its decode answered
        ERROR first) must not free it under the request that holds it now."""
        held = self._quarantine.get(slot)
        if held is not None and held[0] == request_id and self.events is not None:
            del self._quarantine[slot]
            self.events.release(slot)
            return True
        return False

    def link_lost(self, link_id: str) -> list[str]:
        """The link ended: free its leases (returned) and the slots quarantined for its requests
        (the peer closed its event handles with the link); another link's stay quarantined."""
        freed = super().link_lost(link_id)
        for slot, (request_id, link) in list(self._quarantine.items()):
            if link == link_id:
                self.ack_late(slot, request_id)
        return freed

    def close(self) -> None:
        """Idempotent; never raises."""
        self.region.close()
        if self.events is not None:
            self.events.close()


__all__ = ["KVProducer"]
