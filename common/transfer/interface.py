"""What every KV transport does, on each side of a link, and what it declares it can do.

A transport is a producer (the prefill's side, one per process) and a consumer (the decode's
side, one per link), the shape of vLLM's KV connector: the daemons hold a `Producer` and a
`Consumer` and never test which transport they have. What differs between transports is
declared in `Capabilities`, not discovered by the caller:

- `stream_wait`: a pull's `start` returns what a reader's stream waits on (a CUDA event; None
  when the blocks are readable at once). Without it `start` returns AFTER_DONE and the blocks
  are readable only once `done(None)` has run (a NIXL transfer: no local stream can wait on it).
- `early_handoff`: a HANDOFF may go out before its KV is written (no first token); the consumer
  plans the pull (`plan`, then `early`: a transfer the peer drives is asked for now) and starts
  it on KV_READY.
- `frames`: the link frames this side takes in `handle_frame(msg, reply)` (NIXL's PUSH on the
  producer, PUSH_FAILED on the consumer); any other frame is the daemon's.

Abstract base classes, not `typing.Protocol`: both sides share real code (leases and the
slot-less defaults on the producer, `pull` as plan + start on the consumer, no-op hooks), a
subclass that misses a verb fails when it is built rather than when a request first calls it,
and a transport is registered by name (common.transfer.registry), never matched by its shape.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from common.errors import PdkvError
from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool
from common.protocol import ErrorCode, Handoff, Message, MsgType, Register, Registered

PullDone = Callable[[BaseException | None], None]
Reply = Callable[[Message], None]
Ready = Any  # a torch.cuda.Event on CUDA (anything with synchronize(): completion.Waitable)
#: What `start`/`pull` return when the blocks may be read only after `done(None)`.
AFTER_DONE: Any = object()


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one side of a transport can do (module docstring)."""

    stream_wait: bool
    early_handoff: bool
    frames: frozenset[MsgType] = field(default_factory=frozenset)


@dataclass(frozen=True, slots=True)
class PullPlan:
    """A checked pull, ready to start (`Consumer.plan`); `kernel` is the prepared launch on a
    GPU (common.kv.blockcopy.KernelCopy), None where the copy needs none; `tag` the push an early
    HANDOFF asked for already (NixlConsumer.early)."""

    src_ids: list[int]
    dst_ids: list[int]
    slot: int
    kernel: Any = None
    tag: int | None = None  # a NIXL push asked for at plan time (`Consumer.early`)
    # v12: a device int64 [1] the pull also copies the peer's mailbox entry of `slot` into,
    # behind the slot, before its completion event (KV_LAUNCHED: the first token on the GPU)
    first_into: Any = None


class TransferRefused(PdkvError):
    """A REGISTER the consumer cannot honour; `code` is the ERROR to answer with."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Producer(ABC):
    """The prefill's side: one per process, over the daemon's pool and allocator.

    Contract, in the order a link and a request meet it:
    - `register()` gives every new link its REGISTER frame and the fds that travel with it
      (still owned here); `connected(registered, link_id)` takes the decode's REGISTERED.
    - Per request: `acquire_slot()` before the writes (-1 where the transport has no event
      ring, None while every slot is busy), `record(slot, stream)` right after them;
      `lease(rid, link_id, deadline)` when its HANDOFF goes out; `released(rid, slot)` on the
      RELEASE; `quarantine(slot, rid, link_id)` / `ack_late(slot, rid)` / `drop_slot(slot)` for
      a slot of a request that ended otherwise (`link_lost` frees that link's quarantined slots).
    - `handle_frame(msg, reply, link_id)` takes the frames in `caps.frames` that came on link
      `link_id` (`reply` answers on that link); True when it took `msg`.
    - `link_lost(link_id)` frees that link's leases and stops what still moves to its peer;
      `expired(now)` frees overdue leases; `close()` once, after the last link ended.
    - `mailbox` (v12, IPC on CUDA, when asked for): one int64 per event slot on the device, in
      a pool block of its own that REGISTER names; the forward writes a plain greedy request's
      first token into its slot's entry before it records the slot, so a KV_LAUNCHED decode
      reads it on its GPU. None: the transport offers none (no KV_LAUNCHED is sent).
    """

    caps = Capabilities(stream_wait=True, early_handoff=True)
    mailbox: torch.Tensor | None = None

    def __init__(self, pool: KVPool, allocator: BlockAllocator) -> None:
        self.pool = pool
        self.allocator = allocator

    @abstractmethod
    def register(self) -> tuple[Register, list[int]]:
        """The REGISTER frame for a new link and the fds to send with it."""

    def connected(self, ok: Registered, link_id: str | None = None) -> None:
        """The decode's REGISTERED on link `link_id`; PdkvError if the link cannot be used."""
        return None

    def handle_frame(self, msg: Message, reply: Reply, link_id: str) -> bool:
        """Take a frame of this transport's own (`caps.frames`) from link `link_id`; False for
        any other."""
        return False

    # ---- event slots: none unless the transport has a ring ---------------------------------------
    @property
    def event_slots(self) -> int:
        return 0

    def acquire_slot(self) -> int | None:
        return -1

    def record(self, slot: int, stream: object = None) -> None:
        """After the writes `slot` covers, on their stream (torch thread)."""
        return None

    def drop_slot(self, slot: int) -> None:
        """The request ended before the peer could wait on `slot`."""
        return None

    def quarantine(self, slot: int, request_id: str, link_id: str) -> None:
        """The request, handed off on `link_id`, ended after its HANDOFF but before its
        RELEASE."""
        return None

    def ack_late(self, slot: int, request_id: str) -> bool:
        """A late RELEASE (or the answer to an ABORT) for `request_id`; True if it freed the
        slot quarantined for that request."""
        return False

    # ---- leases ----------------------------------------------------------------------------------
    def lease(self, request_id: str, link_id: str, deadline: float) -> None:
        self.allocator.lease(request_id, link_id, deadline)

    def flush(self, request_id: str) -> None:
        """The request's first token is on its way to its client: start what its lease made
        due (NIXL: the WRITE of the PUSH held for its early HANDOFF)."""
        return None

    def forget(self, request_id: str) -> None:
        """The request ended: nothing more moves for it but what its peer awaits already (NIXL:
        a held PUSH is dropped unless its lease made it due; a due one is written)."""
        return None

    def released(self, request_id: str, slot: int) -> bool:
        """RELEASE for a live request: free its blocks and slot; False if it holds none (late)."""
        if request_id not in self.allocator:
            return False
        self.allocator.release(request_id)
        self.drop_slot(slot)
        return True

    def leased_to(self, block_ids: list[int], link_id: str | None) -> str | None:
        """None when every block is leased to `link_id` (to any link where it is None), else
        why not, naming the first block that is not."""
        for block in block_ids:
            if not 0 <= block < self.allocator.num_ids:
                return f"block {block} is outside the pool of {self.allocator.num_ids}"
            holders = self.allocator.lease_holders(block)  # a cached block may be shared
            if not holders:
                return f"block {block} is not leased"
            if link_id is not None and link_id not in holders:
                return f"block {block} is leased to another link"
        return None

    def link_lost(self, link_id: str) -> list[str]:
        """The link ended: free its leases; the request ids freed."""
        return self.allocator.release_holder(link_id) if link_id else []

    def expired(self, now: float) -> list[str]:
        """Free every lease whose deadline is <= now; their request ids, earliest first."""
        overdue = self.allocator.expired(now)
        for rid in overdue:
            self.allocator.free(rid)
        return overdue

    @abstractmethod
    def close(self) -> None:
        """Idempotent; never raises."""


class Consumer(ABC):
    """The decode's side: one per link, over the peer's pool, pulling into `local`.

    Contract:
    - Opened once per link from the peer's REGISTER (common.transfer.registry's ConsumerSide);
      `registered()` is the REGISTERED to answer with.
    - `validate(handoff, vocab_size)` checks one HANDOFF; ValueError or IpcError with why.
    - `plan(src_ids, dst_ids, slot)` checks and prepares a pull (IpcError if it cannot be made);
      `start(plan, done)` starts it, ordered after the peer's writes, and returns what a reader
      waits on (`caps.stream_wait`: an event, or None when the copy is complete already; else
      AFTER_DONE). `start` raises when the copy could not be started, and then `done` never
      runs; otherwise `done(None)` or `done(exc)` runs exactly once, on the loop, once the
      transfer is over: nothing writes the destination blocks after it, so they may be freed
      then, and a RELEASE may go out. `pull` is plan + start.
    - After an early HANDOFF, `early(plan, request_id)` right after `plan`: the transfer a peer
      drives is asked for now, to run once the peer's KV is written (a NIXL push: the PUSH goes,
      the prefill holds it until its KV_READY). A planned request that ends before its `start`
      is `discard`ed: True when what `early` asked for may still write its blocks (`done` then
      runs once nothing can), False when they may be freed now; `may_land` False says the peer
      can no longer write them (it ended the request before its KV was written).
    - `handle_frame(msg, reply)` takes the frames in `caps.frames`; True when it took `msg`.
    - `drain()` waits (bounded where the transport can hang) until no pull reads the peer's
      pool; `close()` (idempotent, after drain) lets go of the peer; a pull whose `done` has
      not run keeps what it uses until it is over.
    """

    caps = Capabilities(stream_wait=True, early_handoff=True)
    local: KVPool
    # v12 (IPC on CUDA): the peer's first-token mailbox, one int64 per event slot, when its
    # REGISTER named one; a plan's `first_into` is then filled from it. None: KV_LAUNCHED unused
    mailbox: torch.Tensor | None = None

    @property
    @abstractmethod
    def kind(self) -> str:
        """The transport as logs and STATUS name it (the IPC backend, nixl-push, ...)."""

    @property
    @abstractmethod
    def peer_blocks(self) -> int:
        """How many blocks the peer's pool has."""

    @property
    def shares_device(self) -> bool:
        """Whether the peer's pool is on this consumer's own device (one GPU for both daemons,
        whose kernels then take turns on it). False by default: another host's memory."""
        return False

    def registered(self) -> Registered:
        """The REGISTERED answering the REGISTER this consumer was opened from."""
        return Registered(num_blocks=self.local.num_blocks)

    @abstractmethod
    def validate(self, h: Handoff, vocab_size: int) -> None: ...

    @abstractmethod
    def plan(self, src_ids: list[int], dst_ids: list[int], slot: int) -> PullPlan: ...

    @abstractmethod
    def start(self, plan: PullPlan, done: PullDone) -> Ready | None: ...

    def pull(
        self, src_ids: list[int], dst_ids: list[int], slot: int, done: PullDone
    ) -> Ready | None:
        """Plan and start a pull of peer blocks src_ids into local dst_ids."""
        return self.start(self.plan(src_ids, dst_ids, slot), done)

    def early(self, plan: PullPlan, request_id: str) -> PullPlan:
        """An early HANDOFF's plan: ask now for what the peer must do (nothing, by default)."""
        return plan

    def warm(self, scratch: int, done: PullDone) -> bool:
        """Pull one peer block into the local block `scratch` the way a request's pull goes, so
        that what a process does only the first time (a kernel's load, the completion thread)
        falls at link setup and not on the first request. The caller owns `scratch` until
        `done` runs (once, as for `start`); False (and `done` never runs) when this transport
        has nothing to warm."""
        return False

    def discard(self, plan: PullPlan, done: PullDone, *, may_land: bool) -> bool:
        """A planned pull that will never start (contract); False: its blocks are free now."""
        return False

    def handle_frame(self, msg: Message, reply: Reply) -> bool:
        """Take a frame of this transport's own (`caps.frames`); False for any other."""
        return False

    @property
    @abstractmethod
    def pulls_in_flight(self) -> int: ...

    @abstractmethod
    async def drain(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


__all__ = [
    "AFTER_DONE",
    "Capabilities",
    "Consumer",
    "Producer",
    "PullDone",
    "PullPlan",
    "Ready",
    "Reply",
    "TransferRefused",
]
