"""The KV transfer across hosts: NIXL siblings of KVProducer and KVConsumer (a TCP link).

No memory is shared and no fd or CUDA event crosses hosts: each daemon registers its own pool
with its NixlAgent once; REGISTER carries the prefill's agent and pool (`NixlRegion`), REGISTERED
the decode's. Blocks move in runs of adjacent blocks (adjacent in both pools), one NIXL request
per HANDOFF:

- **pull** (`transfer="pull"`): the decode READs the HANDOFF's blocks into its own; fast where
  UCX has RDMA (NICs, NVLink), slow over TCP (UCX emulates the read with active messages).
- **push** (`transfer="push"`, the default): the decode allocates its blocks and sends PUSH (a tag
  unique in the decode's agent, source and destination ids); the prefill WRITEs the runs with the NIXL notification
  `pdkv-push:<tag>`, which the decode awaits. A WRITE that fails answers PUSH_FAILED.

Either way `done` runs on the event loop, the RELEASE follows as on one host, and a failed
transfer fails that request only (NixlTransferError), never the link.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

from common.allocator import BlockAllocator
from common.errors import PdkvError
from common.kvpool import KVPool, PoolLayout, block_runs
from common.protocol import (
    ErrorCode,
    Handoff,
    Message,
    NixlRegion,
    Push,
    PushFailed,
    Register,
    Registered,
)
from common.transfer.consumer import (
    AFTER_DONE,
    PullDone,
    TransferRefused,
    check_handoff,
    check_same_blocks,
)
from common.transfer.nixl_agent import NixlAgent, NixlTransferError, Run
from common.transfer.producer import KVProducer

log = structlog.get_logger(__name__)
TRANSFERS = ("push", "pull")


def push_tag(tag: int) -> bytes:
    return b"pdkv-push:%d" % tag


def byte_runs(
    src_ids: list[int], dst_ids: list[int], block_nbytes: int, src_addr: int, dst_addr: int
) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes) of each run of blocks adjacent in both."""
    return [
        (src_addr + s * block_nbytes, dst_addr + d * block_nbytes, n * block_nbytes)
        for s, d, n in block_runs(src_ids, dst_ids)
    ]


def check_region(region: NixlRegion, layout: PoolLayout, whose: str) -> None:
    """A peer's NixlRegion must span exactly its pool of `layout`."""
    if region.nbytes != layout.nbytes:
        raise PdkvError(
            f"{whose} NIXL region is {region.nbytes} bytes, its pool layout needs {layout.nbytes}"
        )


class NixlConsumer:
    """The decode's side of one TCP link; KVConsumer's contract (open, validate, pull, drain,
    close), with `push_failed` for the prefill's PUSH_FAILED."""

    def __init__(
        self,
        local: KVPool,
        agent: NixlAgent,
        region: NixlRegion,
        layout: PoolLayout,
        peer_agent: str,
        post: Callable[[Message], None],
    ) -> None:
        self.local = local
        self.agent = agent
        self.region = region
        self.peer_blocks = layout.num_blocks
        self.peer_agent = peer_agent
        self._post = post
        self._pending: dict[int, PullDone] = {}  # tag -> done, READs and PUSHes in flight
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False

    @classmethod
    def open(
        cls, reg: Register, local: KVPool, agent: NixlAgent, post: Callable[[Message], None]
    ) -> NixlConsumer:
        """From the peer's REGISTER (whose `nixl` is set); TransferRefused as KVConsumer.open."""
        assert reg.nixl is not None
        try:
            layout = PoolLayout.from_wire(reg.layout)
            check_region(reg.nixl, layout, "the prefill's")
        except (PdkvError, ValueError) as exc:
            raise TransferRefused(ErrorCode.BAD_REQUEST, f"bad REGISTER: {exc}") from exc
        check_same_blocks(local.layout, layout)
        if reg.regions or reg.event_count:
            raise TransferRefused(ErrorCode.BAD_REQUEST, "a NIXL REGISTER carries no IPC regions")
        try:
            name = agent.add_peer(reg.nixl)
        except PdkvError as exc:
            raise TransferRefused(ErrorCode.BAD_REQUEST, str(exc)) from exc
        return cls(local, agent, reg.nixl, layout, name, post)

    @property
    def kind(self) -> str:
        return f"nixl-{self.region.transfer}"

    @property
    def peer(self) -> NixlRegion | None:
        return None if self._closed else self.region

    def validate(self, h: Handoff, vocab_size: int) -> None:
        if self._closed:
            raise ValueError("the link's pool is closed")
        check_handoff(
            h, vocab_size, self.local.layout.block_size, self.peer_blocks, 0, early_ok=False
        )

    def pull(self, src_ids: list[int], dst_ids: list[int], slot: int, done: PullDone) -> Any:
        """Move peer blocks src_ids into local dst_ids; `done` once they are here (a failure is
        `done(exc)`: never raises). Returns AFTER_DONE: nothing may read the blocks before."""
        tag = self.agent.new_tag()
        self._pending[tag] = done
        self._idle.clear()
        finish = lambda exc: self._finish(tag, exc)  # noqa: E731
        try:
            if self.region.transfer == "pull":
                bn = self.local.layout.block_nbytes
                runs = byte_runs(dst_ids, src_ids, bn, self.agent.addr, self.region.addr)
                self.agent.transfer("READ", self.peer_agent, runs, b"", finish)
            else:
                self.agent.expect(self.peer_agent, push_tag(tag), finish)
                self._post(Push(tag=tag, src_ids=list(src_ids), dst_ids=list(dst_ids)))
        except Exception as exc:  # the agent closed: fail this request only
            self._finish(tag, exc)
        return AFTER_DONE

    def push_failed(self, msg: PushFailed) -> None:
        """The prefill could not WRITE push `tag`: that request fails (a late notify is ignored)."""
        self._finish(msg.tag, NixlTransferError(f"the prefill's NIXL WRITE failed: {msg.message}"))

    def _finish(self, tag: int, exc: BaseException | None) -> None:
        done = self._pending.pop(tag, None)
        if not self._pending:
            self._idle.set()
        if done is not None:
            done(exc)

    @property
    def pulls_in_flight(self) -> int:
        return len(self._pending)

    async def drain(self, read_timeout_s: float = 30.0) -> None:
        """The link ended. Push: disconnect the peer first (its late WRITEs can no longer land)
        and fail the PUSHes still awaited. Pull: wait for the READs in flight (they write into
        our blocks; bounded: a READ from a vanished host is failed after `read_timeout_s`),
        then disconnect."""
        if self.region.transfer == "push":
            self.agent.remove_peer(self.peer_agent)
            self.agent.forget(self.peer_agent)
            self._fail_pending("the link ended before the push arrived")
        try:
            async with asyncio.timeout(read_timeout_s):
                while self._pending:  # a pull started in the turn that set _idle: wait for it too
                    await self._idle.wait()
        except TimeoutError:
            log.warning("nixl_reads_outlived_link", reads=len(self._pending))
        self.agent.remove_peer(self.peer_agent)
        self._fail_pending("the link ended during the read")

    def _fail_pending(self, why: str) -> None:
        for tag in list(self._pending):
            self._finish(tag, NixlTransferError(why))

    def close(self) -> None:
        """Idempotent; after drain. The agent is the daemon's and outlives the link."""
        if not self._closed:
            self._closed = True
            self.agent.remove_peer(self.peer_agent)


class NixlProducer(KVProducer):
    """The prefill's side over a TCP link: KVProducer's leases and slot verbs (no event ring:
    on CUDA `record` waits for the stream, so the blocks are written before their HANDOFF
    leaves), REGISTER with the pool's NixlRegion, and the WRITEs of push links."""

    def __init__(
        self,
        pool: KVPool,
        allocator: BlockAllocator,
        *,
        transfer: str,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        if transfer not in TRANSFERS:
            raise PdkvError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
        self.pool = pool
        self.allocator = allocator
        self.events = None
        self._quarantine: set[int] = set()
        self.transfer = transfer
        self.agent = NixlAgent("prefill", pool.tensor, loop)
        self._decode: tuple[str, NixlRegion] | None = None

    def register(self) -> tuple[Register, list[int]]:
        reg = Register(
            layout=self.pool.layout.to_wire(), regions=[], nixl=self.agent.region(self.transfer)
        )
        return reg, []

    def record(self, slot: int, stream: object = None) -> None:
        if stream is not None and self.pool.device.type == "cuda":
            stream.synchronize()  # type: ignore[attr-defined]  # no event crosses hosts

    def connected(self, ok: Registered) -> None:
        """The decode's REGISTERED: on a push link, load its agent (PdkvError if unusable)."""
        if self.transfer != "push":
            return
        if ok.nixl is None:
            raise PdkvError("the decode's REGISTERED names no NIXL pool for a push link")
        layout = self.pool.layout
        if ok.nixl.nbytes != ok.num_blocks * layout.block_nbytes:
            raise PdkvError(
                f"the decode's NIXL region is {ok.nixl.nbytes} bytes, "
                f"{ok.num_blocks} blocks need {ok.num_blocks * layout.block_nbytes}"
            )
        self._decode = (self.agent.add_peer(ok.nixl), ok.nixl)

    def push(self, msg: Push, reply: Callable[[Message], None]) -> None:
        """WRITE the blocks PUSH names, notifying its tag; PUSH_FAILED through `reply` if the
        WRITE fails or cannot start (bad ids included). Never raises."""
        try:
            if self._decode is None:
                raise PdkvError("PUSH on a link without the decode's NIXL pool")
            name, region = self._decode
            bn = self.pool.layout.block_nbytes
            dst_blocks = region.nbytes // bn
            if len(msg.src_ids) != len(msg.dst_ids) or not msg.src_ids:
                raise PdkvError("PUSH source and destination id lists differ in length")
            if max(msg.src_ids) >= self.pool.num_blocks or max(msg.dst_ids) >= dst_blocks:
                raise PdkvError("PUSH names a block outside a pool")
            runs: list[Run] = byte_runs(msg.src_ids, msg.dst_ids, bn, self.agent.addr, region.addr)
        except PdkvError as exc:
            reply(PushFailed(tag=msg.tag, message=str(exc)))
            return

        def written(exc: BaseException | None) -> None:
            if exc is not None:
                log.warning("nixl_push_failed", tag=msg.tag, error=str(exc))
                reply(PushFailed(tag=msg.tag, message=str(exc)))

        self.agent.transfer("WRITE", name, runs, push_tag(msg.tag), written)

    def link_lost(self, link_id: str) -> list[str]:
        if self._decode is not None:
            self.agent.remove_peer(self._decode[0])
            self._decode = None
        return super().link_lost(link_id)

    def close(self) -> None:
        self.agent.close()


__all__ = ["TRANSFERS", "NixlConsumer", "NixlProducer", "byte_runs", "push_tag"]
