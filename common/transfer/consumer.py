"""The consumer side of the KV transfer (the decode's): one per link, over the peer's pool.

Contract:
- `KVConsumer.open(reg, fds, local)` once per link, from the peer's REGISTER: the peer's pool is
  mapped (in `local`'s device context, so the copy kernel can read it) and its event ring opened.
  TransferRefused (with the ERROR code to answer) when the REGISTER cannot be honoured; the fds
  are closed either way.
- `validate(handoff, vocab_size)` checks one HANDOFF against the peer's pool and this link's
  ring; ValueError or IpcError with the reason.
- `pull(src_ids, dst_ids, slot, done)` copies peer blocks into `local` ordered after the peer's
  writes, and calls `done(None)` once the copy is complete — at once on CPU (the frame was the
  signal), from a task on CUDA (the pull stream waits on event `slot`, the copy runs on that
  stream, a local event after it is polled from the loop) — or `done(exc)` if it failed. Never
  raises; a RELEASE may go out as soon as `done(None)` runs.
- `drain()` waits for every pull still in flight; `close()` (idempotent, after drain) unmaps the
  peer's pool and closes its events. A mapping is never closed under a copy that reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

import structlog
import torch

from common.blockids import check_block_ids
from common.errors import PdkvError
from common.ipc.backends import backend_for
from common.ipc.base import SharedRegion
from common.ipc.events import ImportedEventRing
from common.kvpool import KVPool, PoolLayout
from common.model.paged import blocks_for
from common.protocol import ErrorCode, Handoff, Register
from common.transfer.regions import open_region

log = structlog.get_logger(__name__)
PullDone = Callable[[BaseException | None], None]


class TransferRefused(PdkvError):
    """A REGISTER the consumer cannot honour; `code` is the ERROR to answer with."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class KVConsumer:
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
        self._pulls: set[asyncio.Task[None]] = set()

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
            _close_fds(fds)
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
        return cls(local, peer, region, events, stream)

    @property
    def kind(self) -> str:
        return self._region.desc.kind

    def validate(self, h: Handoff, vocab_size: int) -> None:
        """Checks of one HANDOFF against the peer's pool; ValueError/IpcError with the reason."""
        if self.peer is None:
            raise ValueError("the link's pool is closed")
        events = len(self._events) if self._events is not None else 0
        check_handoff(h, vocab_size, self.local.layout.block_size, self.peer.num_blocks, events)

    # ---- pulls -----------------------------------------------------------------------------------
    def pull(self, src_ids: list[int], dst_ids: list[int], slot: int, done: PullDone) -> None:
        """Copy peer blocks src_ids into local dst_ids; `done` as the module docstring says."""
        if self._stream is None:
            try:
                self.local.copy_blocks_from(self._peer(), src_ids, dst_ids)
            except Exception as exc:  # a bug or a bad id: fail this pull, never the link
                done(exc)
                return
            done(None)
            return
        task = asyncio.get_running_loop().create_task(self._pull_cuda(src_ids, dst_ids, slot, done))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)

    async def _pull_cuda(
        self, src_ids: list[int], dst_ids: list[int], slot: int, done: PullDone
    ) -> None:
        try:
            peer = self._peer()
            if slot >= 0 and self._events is not None:
                self._events.wait(slot, self._stream)  # the GPU waits, not the CPU
            with torch.cuda.stream(self._stream):
                self.local.copy_blocks_from(peer, src_ids, dst_ids)
                copied = torch.cuda.Event()
                copied.record(self._stream)
            await wait_event(copied)
        except Exception as exc:
            done(exc)
            return
        done(None)

    @property
    def pulls_in_flight(self) -> int:
        return len(self._pulls)

    async def drain(self) -> None:
        """Wait until no pull reads the peer's pool."""
        while self._pulls:
            await asyncio.gather(*self._pulls, return_exceptions=True)

    def _peer(self) -> KVPool:
        if self.peer is None:
            raise PdkvError("the link's pool is closed")
        return self.peer

    def close(self) -> None:
        """Unmap the peer's pool and close its events. Idempotent, never raises; call after
        drain() (a pull still in flight would read unmapped memory)."""
        if self.peer is None:
            return
        if self._pulls:
            log.warning("consumer_closed_with_pulls_in_flight", pulls=len(self._pulls))
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
    h: Handoff, vocab_size: int, block_size: int, peer_blocks: int, event_slots: int
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
    if max(h.prompt_tokens) >= vocab_size or h.first_token >= vocab_size:
        raise ValueError(f"token ids must be < vocab size {vocab_size}")
    ids = h.block_ids  # ints >= 0 already (the frame's schema): range and repeats remain
    if max(ids) >= peer_blocks or len(set(ids)) != len(ids):
        check_block_ids(ids, peer_blocks, "HANDOFF", distinct=True)  # says which
    if h.event_slot >= event_slots:
        raise ValueError(f"event slot {h.event_slot} does not exist on this link")


async def wait_event(event: torch.cuda.Event) -> None:
    """Await a CUDA event without blocking the loop: poll, yielding, then back off to 200 µs."""
    spins = 0
    while not event.query():
        spins += 1
        await asyncio.sleep(0 if spins < 64 else 0.0002)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


__all__ = [
    "KVConsumer",
    "PullDone",
    "TransferRefused",
    "check_handoff",
    "check_same_blocks",
    "wait_event",
]
