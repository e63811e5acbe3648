"""The NIXL producer (the prefill's side of a TCP link): `interface.Producer` across hosts.

The base's leases, no event ring (on CUDA `record` waits for the stream, so the blocks are
written before their HANDOFF leaves), REGISTER with the pool's NixlRegion, and on a push link the
WRITEs that PUSH frames ask for (`handle_frame`):

- A PUSH is written only when every source block is leased to the link it came on (the blocks
  of a HANDOFF on that link, not yet RELEASEd): anything else is refused with PUSH_FAILED, so a
  decode can never have the prefill send blocks that hold another request's KV, or none.
- The early handoff: a PUSH that names its request, whose source blocks are all that request's
  and not leased yet (its HANDOFF went before the forward), is held until the KV is written:
  `lease` to the PUSH's link (KV_READY follows) makes it due, and `flush` WRITEs it once the
  first token is on its way to the client (posting a WRITE takes the GIL from the loop for a
  while: before the first token's frame that was ~0.4 ms of TTFT on the CPU VM); a request that
  ends before that is flushed by the pipeline's cleanup, before its blocks are freed (its decode
  had KV_READY and awaits the WRITE). `forget` (the request ended) drops one not due; the link's
  loss drops both. A PUSH for a request that has ended already (the decode's PUSH crossed the
  ABORT) is answered PUSH_FAILED, logged at info: the decode frees its blocks on the ABORT.
- Each link has its own peer entry (`connected` adds the link's decode agent under the link's
  id): a PUSH is written to the decode of the link it came on, so one prefill serves several
  decodes across hosts, and a link's loss touches only its own entry. Two live links that reach
  the same decode agent are refused (two --decode addresses of one daemon): aborting one link's
  WRITEs would abort the other's.
- When the link ends (`link_lost`) the WRITEs still in flight to its decode are aborted
  (`NixlAgent.cancel`, NIXL's release) before the decode's agent is let go: the decode may
  reuse those blocks for another request. A WRITE that fails on the live link answers
  PUSH_FAILED; an aborted one answers nothing (its link is gone). The abort is what NIXL
  offers, not a fence: under UCX's TCP transport a WRITE released while its target stalled
  still landed once the target ran again (measured), so it narrows the window, no more.
"""

from __future__ import annotations

import asyncio

import structlog

from common.errors import PdkvError
from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool
from common.protocol import Message, MsgType, NixlRegion, Push, PushFailed, Register, Registered
from common.transfer.interface import Capabilities, Producer, Reply
from common.transfer.nixl_agent import NixlAgent, NixlTransferCancelled
from common.transfer.nixl_shared import TRANSFERS, byte_runs, push_tag

log = structlog.get_logger(__name__)


class NixlProducer(Producer):
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
        super().__init__(pool, allocator)
        self.transfer = transfer
        frames = frozenset({MsgType.PUSH}) if transfer == "push" else frozenset()
        self.caps = Capabilities(stream_wait=False, early_handoff=True, frames=frames)
        # pull: the decodes READ our pool and we post nothing, so NIXL's thread progresses UCX
        self.agent = NixlAgent("prefill", pool.tensor, loop, passive=transfer == "pull")
        self._decodes: dict[str, tuple[str, NixlRegion]] = {}  # link id -> (peer agent, pool)
        self._held: dict[str, tuple[Push, Reply, str]] = {}  # request id -> an early PUSH
        self._due: dict[str, tuple[Push, Reply, str]] = {}  # held, its blocks leased: to WRITE

    def register(self) -> tuple[Register, list[int]]:
        reg = Register(
            layout=self.pool.layout.to_wire(), regions=[], nixl=self.agent.region(self.transfer)
        )
        return reg, []

    def record(self, slot: int, stream: object = None) -> None:
        if stream is not None and self.pool.device.type == "cuda":
            stream.synchronize()  # type: ignore[attr-defined]  # no event crosses hosts

    def connected(self, ok: Registered, link_id: str | None = None) -> None:
        """The decode's REGISTERED on link `link_id`: on a push link, load its agent as that
        link's peer (PdkvError if unusable or already another live link's). PUSHes on
        `link_id` then go to this decode and must name blocks leased to `link_id`."""
        if self.transfer != "push":
            return
        if link_id is None:
            raise PdkvError("a NIXL push link needs its link id")
        if ok.nixl is None:
            raise PdkvError("the decode's REGISTERED names no NIXL pool for a push link")
        layout = self.pool.layout
        if ok.nixl.nbytes != ok.num_blocks * layout.block_nbytes:
            raise PdkvError(
                f"the decode's NIXL region is {ok.nixl.nbytes} bytes, "
                f"{ok.num_blocks} blocks need {ok.num_blocks * layout.block_nbytes}"
            )
        if self._decodes.get(link_id) is not None:
            self.link_lost(link_id)  # never two entries for one id (a missed loss)
        for other, (agent, _) in self._decodes.items():
            if agent == ok.nixl.agent:
                raise PdkvError(
                    f"this decode daemon is linked already as {other}: give --decode once per "
                    "decode daemon (two addresses of one daemon are one decode)"
                )
        self._decodes[link_id] = (self.agent.add_peer(ok.nixl), ok.nixl)

    @property
    def peers(self) -> dict[str, str]:
        """Each live push link's decode agent, by link id (status and tests)."""
        return {link: agent for link, (agent, _) in self._decodes.items()}

    def handle_frame(self, msg: Message, reply: Reply, link_id: str) -> bool:
        if isinstance(msg, Push):
            self.push(msg, reply, link_id)
            return True
        return False

    def push(self, msg: Push, reply: Reply, link_id: str) -> None:
        """WRITE the blocks PUSH names into the decode of link `link_id`, notifying its tag;
        PUSH_FAILED through `reply` if the WRITE fails or cannot start (ids outside a pool or
        not leased to this link included). Never raises."""
        decode = self._decodes.get(link_id)
        try:
            if decode is None:
                raise PdkvError("PUSH on a link without the decode's NIXL pool")
            name, region = decode
            bn = self.pool.layout.block_nbytes
            if len(msg.src_ids) != len(msg.dst_ids) or not msg.src_ids:
                raise PdkvError("PUSH source and destination id lists differ in length")
            if max(msg.dst_ids) >= region.nbytes // bn:
                raise PdkvError("PUSH names a block outside a pool (destination)")
            if why := self.leased_to(msg.src_ids, link_id):
                if self._hold(msg, reply, link_id):
                    return
                if msg.request_id is not None and msg.request_id not in self.allocator:
                    log.info("nixl_push_for_ended_request", tag=msg.tag, request_id=msg.request_id)
                    reply(PushFailed(tag=msg.tag, message="the request has ended"))
                    return
                raise PdkvError(f"PUSH refused: {why}")
            runs = byte_runs(msg.src_ids, msg.dst_ids, bn, self.agent.addr, region.addr)
        except PdkvError as exc:
            log.warning("nixl_push_refused", tag=msg.tag, link=link_id, error=str(exc))
            reply(PushFailed(tag=msg.tag, message=str(exc)))
            return

        def written(exc: BaseException | None) -> None:
            if exc is None or isinstance(exc, NixlTransferCancelled):
                return
            log.warning("nixl_push_failed", tag=msg.tag, link=link_id, error=str(exc))
            if self._decodes.get(link_id) is decode:  # still the link that asked: tell it
                reply(PushFailed(tag=msg.tag, message=str(exc)))

        self.agent.transfer("WRITE", name, runs, push_tag(msg.tag), written)

    def _hold(self, msg: Push, reply: Reply, link_id: str) -> bool:
        """Hold an early handoff's PUSH until its KV is written (module docstring): True when
        `msg` is one (its request's own blocks, none leased yet, none held for it already)."""
        rid = msg.request_id
        if rid is None or rid not in self.allocator or rid in self._held or rid in self._due:
            return False
        if self.allocator.lease_of(rid) is not None:
            return False
        if not set(msg.src_ids) <= set(self.allocator.blocks_of(rid)):
            return False
        self._held[rid] = (msg, reply, link_id)
        return True

    def lease(self, request_id: str, link_id: str, deadline: float) -> None:
        """Lease; the PUSH held for the request, if it came on `link_id`, is due (`flush`)."""
        super().lease(request_id, link_id, deadline)
        held = self._held.pop(request_id, None)
        if held is not None:
            msg, _, on = held
            if on == link_id:
                self._due[request_id] = held
            else:  # not the link that planned it (never, unless a decode misbehaves)
                log.warning("nixl_push_dropped", tag=msg.tag, link=on, leased_to=link_id)

    def flush(self, request_id: str) -> None:
        """WRITE the request's due PUSH, if any."""
        due = self._due.pop(request_id, None)
        if due is not None:
            msg, reply, link_id = due
            self.push(msg, reply, link_id)

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        self.flush(request_id)  # flushed by the cleanup already; else its decode still awaits it

    def link_lost(self, link_id: str) -> list[str]:
        """Abort the WRITEs still in flight to the link's decode, let its agent go (once they
        are over), drop the PUSHes it has held, then free the link's leases. Other links'
        decodes are not touched."""
        for held in (self._held, self._due):
            for rid in [rid for rid, (_, _, on) in held.items() if on == link_id]:
                del held[rid]
        decode = self._decodes.pop(link_id, None)
        if decode is not None:
            name = decode[0]
            self.agent.cancel(name)
            self.agent.remove_peer(name)
        return super().link_lost(link_id)

    def close(self) -> None:
        self.agent.close()


__all__ = ["NixlProducer"]
