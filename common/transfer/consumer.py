"""The IPC consumer (the decode's side of a Unix-socket link): one per link, over the peer's pool.

`KVConsumer` is `interface.Consumer` for a peer on this host, whose pool it maps:
- `KVConsumer.open(reg, take_fds, local, stream)` once per link, from the peer's REGISTER: the
  peer's pool is mapped (in `local`'s device context, so the copy kernel can read it) and its
  event ring opened. TransferRefused (with the ERROR code to answer) when the REGISTER cannot
  be honoured; the fds are closed either way.
- `plan` checks ids and, on CUDA, prepares the kernel launch (the decode plans an early
  HANDOFF's pull while the prefill computes), so `start` is the enqueue alone:
  - CPU: the copy runs inline (the frame was the signal); `done(None)` runs before `start`
    returns, and `start` returns None: the blocks may be read at once.
  - CUDA: the pull stream waits on the peer's event `slot` (the GPU waits, not the CPU), the copy
    is enqueued behind it, and `start` returns an event recorded after the copy. A reader makes
    its own stream wait on that event before it reads the blocks; a waiter thread
    (transfer.completion) observes the event and runs `done` on the loop once it completed.
- `drain()` waits until every started pull has completed and its `done` has run; `close()`
  (idempotent, after drain) unmaps the peer's pool, closes its events and stops the waiter. A
  mapping is never closed under a copy that reads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
import torch

from common.errors import IpcError, PdkvError
from common.ipc.backends import backend_for
from common.ipc.base import SharedRegion
from common.ipc.events import ImportedEventRing
from common.kv.blockids import check_block_ids
from common.kv.pool import KVPool, PoolLayout
from common.model.paged import blocks_for
from common.protocol import ErrorCode, Handoff, Register
from common.transfer.completion import CompletionWaiter
from common.transfer.interface import (
    AFTER_DONE,
    Consumer,
    PullDone,
    PullPlan,
    Ready,
    TransferRefused,
)
from common.transfer.regions import close_fds, open_region

log = structlog.get_logger(__name__)


class KVConsumer(Consumer):
    """`interface.Consumer` over a peer pool mapped into this process (module docstring)."""

    def __init__(
        self,
        local: KVPool,
        peer: KVPool,
        region: SharedRegion,
        events: ImportedEventRing | None,
        stream: torch.cuda.Stream | None,
    ) -> None:
        self.local = local
        self.peer: KVPool | None = peer
        self._region = region
        self._events = events
        self._stream = stream
        self._waiter: CompletionWaiter | None = None  # started by the first CUDA pull
        self._in_flight = 0  # pulls started and not yet reported complete
        self._idle = asyncio.Event()
        self._idle.set()

    @classmethod
    def open(
        cls,
        reg: Register,
        take_fds: Callable[[int], list[int]],
        local: KVPool,
        stream: torch.cuda.Stream | None = None,
    ) -> KVConsumer:
        """Open the peer's pool (the first and only region of REGISTER) and event ring.
        `take_fds(n)` gives the fds that came with the frame, taken once REGISTER's own checks
        passed (from then on they are closed here or owned by the mapping). `stream`: the pull
        stream on CUDA, None on CPU."""
        try:
            layout = PoolLayout.from_wire(reg.layout)
            descs = reg.descriptors()
            event_handles = reg.event_handle_list()
            if event_handles and local.device.type != "cuda":
                raise ValueError("event handles on a CPU link (the frame is the signal there)")
            if reg.nixl is not None:
                raise ValueError("a NIXL REGISTER on a Unix-socket link")
        except (PdkvError, ValueError) as exc:
            raise TransferRefused(ErrorCode.BAD_REQUEST, f"bad REGISTER: {exc}") from exc
        check_same_blocks(local.layout, layout)
        if len(descs) != 1:
            raise TransferRefused(
                ErrorCode.BAD_REQUEST, f"expected 1 pool region, got {len(descs)}"
            )
        fds = take_fds(sum(r.num_fds for r in reg.regions))
        try:
            backend_for(descs[0].kind)  # an unknown kind is INCOMPATIBLE, not a bad REGISTER
        except PdkvError as exc:
            close_fds(fds)
            raise TransferRefused(ErrorCode.INCOMPATIBLE, str(exc)) from exc
        try:
            region = open_region(descs[0], fds, local.device)  # owns the fds from here on
        except PdkvError as exc:
            raise TransferRefused(
                ErrorCode.BAD_REQUEST, f"cannot open the peer's pool: {exc}"
            ) from exc
        try:
            peer = KVPool(layout, region.to_tensor())
        except PdkvError as exc:
            region.close()
            raise TransferRefused(
                ErrorCode.BAD_REQUEST, f"cannot open the peer's pool: {exc}"
            ) from exc
        events = None
        if event_handles:
            try:
                events = ImportedEventRing.open(event_handles, local.device)
            except (PdkvError, RuntimeError, ValueError) as exc:
                region.close()
                raise TransferRefused(
                    ErrorCode.BAD_REQUEST, f"cannot open the peer's event handles: {exc}"
                ) from exc
        consumer = cls(local, peer, region, events, stream)
        if reg.mailbox_block >= 0 and events is not None:
            try:
                consumer.mailbox = peer.words(reg.mailbox_block, len(events))
            except IpcError as exc:
                consumer.close()
                raise TransferRefused(
                    ErrorCode.BAD_REQUEST, f"bad REGISTER: mailbox_block: {exc}"
                ) from exc
        return consumer

    @property
    def kind(self) -> str:
        return self._region.desc.kind

    @property
    def peer_blocks(self) -> int:
        return self._peer().num_blocks

    @property
    def shares_device(self) -> bool:
        peer = self.peer
        return peer is not None and peer.device == self.local.device

    def into(self, local: KVPool) -> KVConsumer:
        """This link, pulling into another local pool of the same layout on the same device
        (CacheManager pulls one import into many caches). The view shares the mapping, the ring
        and the pull stream and owns none of them: pull through it, never close() it; close this
        consumer once no view pulls. IpcError if `local` cannot receive the peer's blocks."""
        peer = self._peer()
        if local.layout.compat_fields() != peer.layout.compat_fields():
            raise IpcError("caches of different layouts cannot exchange blocks")
        if local.device != self.local.device:
            raise IpcError(f"this link pulls into {self.local.device}, not {local.device}")
        return KVConsumer(local, peer, self._region, self._events, self._stream)

    def validate(self, h: Handoff, vocab_size: int) -> None:
        """Checks of one HANDOFF against the peer's pool; ValueError/IpcError with the reason."""
        if self.peer is None:
            raise ValueError("the link's pool is closed")
        events = len(self._events) if self._events is not None else 0
        check_handoff(h, vocab_size, self.local.layout.block_size, self.peer.num_blocks, events)

    # ---- pulls ---------------------------------------------------------------------------------
    def plan(self, src_ids: list[int], dst_ids: list[int], slot: int) -> PullPlan:
        """The pull checked and prepared, not started (IpcError if it cannot be made)."""
        peer = self._peer()
        if slot >= 0 and self._events is not None and slot >= len(self._events):
            raise IpcError(f"event slot {slot} out of range for a ring of {len(self._events)}")
        kernel = (
            None if self._stream is None else self.local.plan_kernel_copy(peer, src_ids, dst_ids)
        )
        return PullPlan(src_ids, dst_ids, slot, kernel)

    def start(self, plan: PullPlan, done: PullDone) -> Ready | None:
        """Start a planned pull: None when the copy is complete already (CPU), else the event a
        reader's stream waits on; raises if the copy could not be started, else `done` runs
        once."""
        peer = self._peer()
        if self._stream is None:
            self.local.copy_blocks_from(peer, plan.src_ids, plan.dst_ids)
            done(None)
            return None
        ready = self._enqueue(peer, plan)
        self._track(ready, done)
        return ready

    def warm(self, scratch: int, done: PullDone) -> bool:
        """CUDA: the peer's block 0 copied into `scratch` on the pull stream, tracked by the
        waiter thread (interface.Consumer.warm). On the H200 a fresh decode's first pull took
        30 ms to enqueue and held its loop meanwhile, with every KV_READY of the first burst
        behind it. No event slot is waited on: the copy may read a block the peer is writing,
        into a block nobody reads."""
        if self._stream is None:
            return False
        peer = self._peer()
        ready = self._enqueue(peer, self.plan([0], [scratch], -1))
        self._track(ready, done)
        return True

    def _enqueue(self, peer: KVPool, plan: PullPlan) -> Ready:
        """CUDA: the pull stream waits on the peer's event `slot`, the copy follows on that
        stream, and an event recorded after it is returned. Nothing here waits on the host."""
        if plan.slot >= 0 and self._events is not None:
            self._events.wait(plan.slot, self._stream)  # the GPU waits, not the CPU
        if plan.kernel is not None:
            plan.kernel.launch(self._stream)
        else:
            self.local.copy_blocks_from(peer, plan.src_ids, plan.dst_ids, self._stream)
        if plan.first_into is not None and self.mailbox is not None and plan.slot >= 0:
            with torch.cuda.stream(self._stream):  # behind the slot: the first token is written
                plan.first_into.copy_(self.mailbox[plan.slot : plan.slot + 1], non_blocking=True)
        copied = torch.cuda.Event(blocking=True)  # the waiter thread sleeps on it, never spins
        copied.record(self._stream)
        return copied

    def _track(self, ready: Ready, done: PullDone) -> None:
        """Count the pull in flight until the waiter thread reports it complete."""
        if self._waiter is None:
            self._waiter = CompletionWaiter(asyncio.get_running_loop())
        self._in_flight += 1
        self._idle.clear()

        def complete(exc: BaseException | None) -> None:  # on the loop
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()
            done(exc)

        self._waiter.watch(ready, complete)

    @property
    def pulls_in_flight(self) -> int:
        return self._in_flight

    async def drain(self) -> None:
        """Wait until no pull reads the peer's pool (every started pull's `done` has run)."""
        while self._in_flight:
            await self._idle.wait()

    def _peer(self) -> KVPool:
        if self.peer is None:
            raise PdkvError("the link's pool is closed")
        return self.peer

    def close(self) -> None:
        """Unmap the peer's pool and close its events. Idempotent, never raises; call after
        drain() (a pull still in flight would read unmapped memory)."""
        if self.peer is None:
            return
        if self._in_flight:
            log.warning("consumer_closed_with_pulls_in_flight", pulls=self._in_flight)
        elif self._waiter is not None:
            self._waiter.close()  # idle: returns at once (with pulls in flight, leave it be)
        self.peer = None
        if self._events is not None:
            self._events.close()
            self._events = None
        self._region.close()


def check_same_blocks(local: PoolLayout, peer: PoolLayout) -> None:
    """TransferRefused(INCOMPATIBLE) unless the two pools' blocks have one shape and dtype."""
    mine, theirs = local.compat_fields(), peer.compat_fields()
    if theirs != mine:
        raise TransferRefused(
            ErrorCode.INCOMPATIBLE, f"peer pool layout {theirs} differs from ours {mine}"
        )


def check_handoff(
    h: Handoff,
    vocab_size: int,
    block_size: int,
    peer_blocks: int,
    event_slots: int,
) -> None:
    """One HANDOFF against the peer's pool of `peer_blocks` blocks and a ring of `event_slots`
    slots; ValueError/IpcError with the reason. Every consumer kind checks with this."""
    h.sampling.validate()
    if h.num_tokens != len(h.prompt_tokens) or h.num_tokens == 0:
        raise ValueError(f"num_tokens {h.num_tokens} != {len(h.prompt_tokens)} prompt tokens")
    need = blocks_for(h.num_tokens, block_size)
    if len(h.block_ids) != need:
        raise ValueError(
            f"{h.num_tokens} tokens need {need} blocks, HANDOFF names {len(h.block_ids)}"
        )
    first = h.first_token
    if max(h.prompt_tokens) >= vocab_size or (first is not None and first >= vocab_size):
        raise ValueError(f"token ids must be < vocab size {vocab_size}")
    ids = h.block_ids  # ints >= 0 already (the frame's schema): range and repeats remain
    if max(ids) >= peer_blocks or len(set(ids)) != len(ids):
        check_block_ids(ids, peer_blocks, "HANDOFF", distinct=True)  # says which
    if h.event_slot >= event_slots:
        raise ValueError(f"event slot {h.event_slot} does not exist on this link")


__all__ = [
    "AFTER_DONE",
    "KVConsumer",
    "PullDone",
    "PullPlan",
    "Ready",
    "TransferRefused",
    "check_handoff",
    "check_same_blocks",
]
