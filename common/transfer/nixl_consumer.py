"""The NIXL consumer (the decode's side of a TCP link): `interface.Consumer` across hosts.

No memory is shared and no fd or CUDA event crosses hosts: each daemon registers its own pool
with its NixlAgent once; REGISTER carries the prefill's agent and pool (`NixlRegion`), REGISTERED
the decode's (`registered()`, on a push link). One NIXL request per HANDOFF:

- **pull** (`transfer="pull"`): the decode READs the HANDOFF's blocks into its own; fast where
  UCX has RDMA (NICs, NVLink), slow over TCP (UCX emulates the read with active messages).
- **push** (`transfer="push"`, the default): the decode sends PUSH (a tag unique in the decode's
  agent, source and destination ids); the prefill WRITEs the runs with the notification
  `pdkv-push:<tag>`, which NIXL delivers after the data and the decode awaits. A WRITE that
  fails comes back as PUSH_FAILED (`handle_frame`).

The early handoff: after an early HANDOFF `early` sends the PUSH at once, with the request id,
and the prefill holds it until the KV is written (then it leases the blocks, WRITEs and sends
KV_READY), so the WRITE starts on the prefill's own turn and the notification may come before
KV_READY does: `start` then calls `done` at once. A pull link READs on KV_READY (`start`). A
planned push whose request ends before KV_READY is `discard`ed: forgotten when the prefill ended
the request (its ABORT came instead of KV_READY: it never writes), else awaited like a started
one, since the prefill may have sent the WRITE just before the link or the request ended.

No local stream can wait on either: `start` returns AFTER_DONE and the blocks are read only
after `done(None)`. A failed transfer fails that request only (NixlTransferError), never the
link. A READ's `done` runs when NIXL reports it DONE or ERR, never before, since the decode
frees its blocks right after: a READ that outlives `drain`'s bound is left to end (it is not
released: under UCX's TCP transport a released READ still wrote its bytes once the peer answered,
measured), and `close` leaves the peer to the agent, which forgets it only once no READ from it
is in flight. A host that vanished fails its READs when UCX gives up on it.

A PUSH still awaited when the link ends is the prefill's WRITE, which may still land: the
prefill aborts the WRITEs to a lost link (its `link_lost`), but only once it sees the loss, up to
its heartbeat timeout later. So `drain` does not fail an awaited push at once: its `done`, and so
its blocks, wait for the notification (the WRITE landed) or for PUSH_GRACE_S, by which the
prefill has aborted it; only then are those notifications forgotten (by tag: the same prefill,
reconnected, may await others).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import structlog

from common.errors import IpcError, PdkvError
from common.kv.blockids import check_block_ids
from common.kv.pool import KVPool, PoolLayout
from common.protocol import (
    ErrorCode,
    Handoff,
    Message,
    MsgType,
    NixlRegion,
    Push,
    PushFailed,
    Register,
    Registered,
)
from common.transfer.consumer import check_handoff, check_same_blocks
from common.transfer.interface import (
    AFTER_DONE,
    Capabilities,
    Consumer,
    PullDone,
    PullPlan,
    Reply,
    TransferRefused,
)
from common.transfer.nixl_agent import NixlAgent, NixlTransferError
from common.transfer.nixl_shared import byte_runs, check_region, push_tag

#: how long the blocks of a push still awaited when its link ended stay held (module docstring):
#: above any sane --heartbeat-timeout (default 5 s) of the prefill, plus its abort's own time
PUSH_GRACE_S = 30.0

log = structlog.get_logger(__name__)


class NixlConsumer(Consumer):
    """The decode's side of one TCP link (module docstring)."""

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
        self._peer_blocks = layout.num_blocks
        self.peer_agent = peer_agent
        self._post = post
        # tag -> done, READs and PUSHes in flight; None: an early push not started yet
        self._pending: dict[int, PullDone | None] = {}
        self._arrived: dict[int, BaseException | None] = {}  # early pushes over before `start`
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self._holds_peer = True  # this link's count on the peer agent (NixlAgent.add_peer)
        self._grace: asyncio.TimerHandle | None = None  # the push hold after drain (docstring)
        frames = frozenset({MsgType.PUSH_FAILED}) if region.transfer == "push" else frozenset()
        self.caps = Capabilities(stream_wait=False, early_handoff=True, frames=frames)

    @classmethod
    def open(
        cls, reg: Register, local: KVPool, agent: NixlAgent, post: Callable[[Message], None]
    ) -> NixlConsumer:
        """From the peer's REGISTER; TransferRefused with the ERROR to answer otherwise."""
        if reg.nixl is None:
            raise TransferRefused(ErrorCode.BAD_REQUEST, "a TCP link's REGISTER names no NIXL pool")
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
    def peer_blocks(self) -> int:
        return self._peer_blocks

    @property
    def peer(self) -> NixlRegion | None:
        return None if self._closed else self.region

    def registered(self) -> Registered:
        """A push link's REGISTERED names our pool, which the prefill WRITEs into."""
        push = self.region.transfer == "push"
        nixl = self.agent.region("push") if push else None
        return Registered(num_blocks=self.local.num_blocks, nixl=nixl)

    def validate(self, h: Handoff, vocab_size: int) -> None:
        if self._closed:
            raise ValueError("the link's pool is closed")
        check_handoff(h, vocab_size, self.local.layout.block_size, self._peer_blocks, 0)

    # ---- pulls -----------------------------------------------------------------------------------
    def plan(self, src_ids: list[int], dst_ids: list[int], slot: int) -> PullPlan:
        """The ids checked against both pools (IpcError); nothing to prepare beyond them."""
        if self._closed:
            raise PdkvError("the link's pool is closed")
        if len(src_ids) != len(dst_ids) or not src_ids:
            raise IpcError(f"{len(src_ids)} source and {len(dst_ids)} destination blocks")
        check_block_ids(src_ids, self._peer_blocks, "source")
        check_block_ids(dst_ids, self.local.num_blocks, "destination", distinct=True)
        return PullPlan(list(src_ids), list(dst_ids), slot)

    def early(self, plan: PullPlan, request_id: str) -> PullPlan:
        """Push: send the PUSH now (the prefill WRITEs it once the KV is written); its outcome
        waits for `start`. Pull: nothing to ask for before KV_READY."""
        if self.region.transfer != "push":
            return plan
        if self._closed:
            raise PdkvError("the link's pool is closed")
        tag = self._push(plan, None, request_id)
        return dataclasses.replace(plan, tag=tag)

    def start(self, plan: PullPlan, done: PullDone) -> object:
        """Post the READ, or send the PUSH and await its notification (after `early`: await
        the PUSH sent then, `done` at once if it is over); `done` once the blocks are here or
        the transfer failed. Returns AFTER_DONE: nothing may read them before."""
        if plan.tag is not None:
            tag = plan.tag
            if tag in self._arrived:
                done(self._arrived.pop(tag))
            elif tag in self._pending and self._pending[tag] is None:
                self._pending[tag] = done
                # KV_READY: the WRITE lands about now; after a whole forward's wait the
                # worker polls at 1 ms, which put ~1 ms into the 2nd token (H200, 2026-12-03)
                self.agent.hurry()
            else:
                raise PdkvError(f"push {tag} was started or discarded already")
            return AFTER_DONE
        if self._closed:
            raise PdkvError("the link's pool is closed")
        if self.region.transfer == "push":
            self._push(plan, done, None)
            return AFTER_DONE
        tag = self.agent.new_tag()
        self._pending[tag] = done
        self._idle.clear()
        try:
            bn = self.local.layout.block_nbytes
            runs = byte_runs(plan.dst_ids, plan.src_ids, bn, self.agent.addr, self.region.addr)
            self.agent.transfer("READ", self.peer_agent, runs, b"", lambda e: self._finish(tag, e))
        except Exception as exc:  # the agent closed: fail this request only
            self._finish(tag, exc)
        return AFTER_DONE

    def _push(self, plan: PullPlan, done: PullDone | None, request_id: str | None) -> int:
        """Await the notification of a new tag and send its PUSH; the tag."""
        tag = self.agent.new_tag()
        self._pending[tag] = done
        self._idle.clear()
        try:
            self.agent.expect(self.peer_agent, push_tag(tag), lambda e: self._finish(tag, e))
            push = Push(tag=tag, src_ids=plan.src_ids, dst_ids=plan.dst_ids, request_id=request_id)
            self._post(push)
        except Exception as exc:  # the agent closed: fail this request only
            self._finish(tag, exc)
        return tag

    def discard(self, plan: PullPlan, done: PullDone, *, may_land: bool) -> bool:
        """An early push whose request ended before `start`: forgotten when it cannot land
        (False: its blocks may be freed now), else awaited (True: `done` once it landed,
        failed, or the link's grace ran out)."""
        tag = plan.tag
        if tag is not None and tag in self._arrived:  # it landed (or failed) already
            del self._arrived[tag]
            return False
        if tag is None or tag not in self._pending:
            return False
        if may_land:
            self._pending[tag] = done
            return True
        del self._pending[tag]
        self.agent.forget(self.peer_agent, [push_tag(tag)])
        self._check_idle()
        return False

    def handle_frame(self, msg: Message, reply: Reply) -> bool:
        if isinstance(msg, PushFailed):
            self.push_failed(msg)
            return True
        return False

    def push_failed(self, msg: PushFailed) -> None:
        """The prefill could not WRITE push `tag`: that request fails (a late notify is ignored)."""
        self._finish(msg.tag, NixlTransferError(f"the prefill's NIXL WRITE failed: {msg.message}"))

    def _finish(self, tag: int, exc: BaseException | None) -> None:
        if tag not in self._pending:
            return  # discarded, or a late notification
        done = self._pending.pop(tag)
        if done is None:  # an early push over before its `start`: it takes the outcome
            self._arrived[tag] = exc
        self._check_idle()
        if done is not None:
            done(exc)

    def _check_idle(self) -> None:
        if not self._pending:
            self._idle.set()
            if self._grace is not None:  # the last push held after its link ended is over
                self._end_grace()

    @property
    def pulls_in_flight(self) -> int:
        return len(self._pending)

    async def drain(self, read_timeout_s: float = 30.0, push_grace_s: float = PUSH_GRACE_S) -> None:
        """The link ended. Push: the PUSHes still awaited keep their `done`, and so their
        blocks, until their WRITE lands or `push_grace_s` passed (then they fail); the peer is
        let go once none is left. Pull: wait for the READs in flight (they write into our
        blocks), at most `read_timeout_s`; a READ still in flight then keeps its `done`, and so
        its blocks, until NIXL reports it over."""
        if self.region.transfer == "push":
            if not self._pending:
                self._end_grace()
            elif self._grace is None:
                log.warning(
                    "nixl_pushes_outlived_link",
                    pushes=len(self._pending),
                    peer=self.peer_agent,
                    hold_s=push_grace_s,
                )
                loop = asyncio.get_running_loop()
                self._grace = loop.call_later(push_grace_s, self._grace_over)
            return
        try:
            async with asyncio.timeout(read_timeout_s):
                while self._pending:  # a pull started in the turn that set _idle: wait for it too
                    await self._idle.wait()
        except TimeoutError:
            log.warning("nixl_reads_outlived_link", reads=len(self._pending), peer=self.peer_agent)

    def _grace_over(self) -> None:
        """The prefill has surely aborted its WRITEs to this link by now: fail what is left."""
        tags = list(self._pending)
        self.agent.forget(self.peer_agent, [push_tag(tag) for tag in tags])
        for tag in tags:
            self._finish(tag, NixlTransferError("the link ended before the push arrived"))
        self._end_grace()

    def _end_grace(self) -> None:
        """No push of this ended link is awaited any more: let the peer go."""
        if self._grace is not None:
            self._grace.cancel()
        self._grace = None
        self._let_go()

    def _let_go(self) -> None:
        if self._holds_peer:
            self._holds_peer = False
            self.agent.remove_peer(self.peer_agent)

    def close(self) -> None:
        """Idempotent; after drain. The agent is the daemon's and outlives the link; it forgets
        the peer once no link uses it and no READ from it is in flight; a push link keeps it
        while a push is held (drain)."""
        if not self._closed:
            self._closed = True
            if self._grace is None:
                self._let_go()


__all__ = ["NixlConsumer"]
