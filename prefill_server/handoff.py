"""The handoff of a request to the decode, the one way it is sent: offer, ready, hand_over, end.

- `offer`: HANDOFF, without its first token (the early handoff, while the forward runs: the KV is
  not written) or with it (the KV written: the blocks are leased to the link first).
- `launched`: KV_LAUNCHED after an early offer (v12, CUDA), once the forward, the first token's
  mailbox entry and the slot's record are queued on the GPU: the decode may queue its pull and
  first step behind the slot; KV_READY (which leases the blocks) still follows.
- `ready`: KV_READY after an early offer, once the first token is on our host: the KV is written,
  the decode's pull may start (the blocks are leased to the link first).
- `hand_over`: after the first token, offers the request unless it went early, and while a
  decode answers NO_CAPACITY offers it again (with its first token): at once to another decode
  that has not refused it, else after a backoff to the least loaded, until the handoff deadline;
  returns the decode's first other answer.

Each offer picks the decode (prefill_server.decode_links: the least loaded link that is up); the
request's `link_id` names the connection it went on, and every later frame for it goes there.
- `end`: the request ended: ABORT to a decode that may hold it; its event slot freed, or
  quarantined while the decode may wait on it (the request is then ABORTING).

Each moves the request's phase (prefill_server.phase) through `advance`; what `end` does follows
from the phase alone: a lost link has already moved its requests to DONE (`link_lost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from common.kv.allocator import BlockAllocator
from common.protocol import Abort, Error, ErrorCode, Handoff, KvLaunched, KvReady, Message
from common.transfer import Producer
from prefill_server.config import PrefillConfig
from prefill_server.decode_links import DecodeLinks
from prefill_server.link import DecodeLink
from prefill_server.phase import Event, Phase
from prefill_server.request import PrefillRequest, RequestFailed

_DECODE_MAY_HOLD = (Phase.OFFERED, Phase.LAUNCHED, Phase.LEASED, Phase.RELEASED)
# on the event slot and reading the blocks: both kept if it ends (ABORTING)
_DECODE_MAY_WAIT = (Phase.LAUNCHED, Phase.LEASED)


class HandoffPath:
    """Sends every HANDOFF, KV_READY and ABORT of the pipeline's requests on their links."""

    def __init__(
        self,
        cfg: PrefillConfig,
        producer: Producer,
        links: DecodeLinks,
        allocator: BlockAllocator,
    ) -> None:
        self.cfg = cfg
        self.producer = producer
        self.links = links
        self.allocator = allocator
        self._on: dict[str, DecodeLink] = {}  # request id → the link whose load counts it

    async def link_up(self, deadline: float) -> None:
        """LINK_LOST unless a link is up or comes up at the next connection attempt: no
        prefill work for a request that cannot be handed off."""
        try:
            await self.links.wait_any_up(deadline - time.monotonic())
        except ConnectionError as exc:
            raise RequestFailed(ErrorCode.LINK_LOST, str(exc)) from None

    async def offer(
        self,
        req: PrefillRequest,
        first_token: int | None,
        deadline: float,
        *,
        spin: bool = False,
        refused: frozenset[str] = frozenset(),
    ) -> None:
        """HANDOFF to the least loaded decode that is up and not in `refused` (link ids); with
        `first_token` the blocks are leased to its link first (their KV is written). LINK_LOST
        if no link is up past `deadline` or the write fails: then the decode cannot act on the
        frame and the blocks and slot are ours again."""
        await self.link_up(deadline)
        link = self.links.pick(refused) or self.links.pick()
        if link is None:  # it dropped since link_up returned
            raise RequestFailed(ErrorCode.LINK_LOST, "no link to any decode daemon is up")
        self._count(req, link)
        req.link_id = link.link_id
        sent = req.marks.stamp("handoff_sent")
        if first_token is None:
            req.advance(Event.OFFER_EARLY)
        else:
            req.advance(Event.OFFER)
            self._lease(req)
            req.marks.stamp("kv_offered", sent)
        handoff = Handoff(
            request_id=req.request_id,
            block_ids=req.blocks,
            num_tokens=len(req.prompt_tokens),
            prompt_tokens=req.prompt_tokens,
            first_token=first_token,
            sampling=req.sampling,
            event_slot=req.event_slot,
            sent_ns=sent,
        )
        try:
            await link.send(handoff, spin=spin)
        except ConnectionError as exc:
            req.advance(Event.UNSENT)
            raise RequestFailed(ErrorCode.LINK_LOST, str(exc)) from None

    def launched(self, req: PrefillRequest) -> None:
        """After an early offer the decode has not answered yet, its forward, first token
        (mailbox) and slot record queued on the GPU: KV_LAUNCHED on the link that has the
        HANDOFF. The blocks stay ours (KV_READY leases them), so a link lost meanwhile sends
        the request to another decode as for an early offer; its slot is quarantined if it
        ends now (the decode may wait on it). Nothing else changes for a request past that."""
        if req.phase is not Phase.OFFERED or not req.inbox.empty():
            return
        link = self.links.by_id(req.link_id)
        if link is None:  # lost: link_lost moved the request on
            return
        req.advance(Event.LAUNCH)
        sent = req.marks.stamp("kv_launched")
        link.post(KvLaunched(request_id=req.request_id, sent_ns=sent))

    async def ready(self, req: PrefillRequest, first: int) -> None:
        """After an early offer the decode has not answered yet (KV_LAUNCHED may have gone):
        KV_READY with its first token, on the link that has the HANDOFF. A failed write is the
        relay's to report (LINK_LOST, from link_lost)."""
        if req.phase not in (Phase.OFFERED, Phase.LAUNCHED) or not req.inbox.empty():
            return
        req.advance(Event.READY)
        self._lease(req)
        sent = req.marks.stamp("kv_offered")  # the decode's pull starts on this frame
        msg = KvReady(request_id=req.request_id, first_token=first, sent_ns=sent)
        link = self.links.by_id(req.link_id)
        if link is not None:  # else it was lost, and link_lost answered the request
            with contextlib.suppress(ConnectionError):
                await link.send(msg, spin=True)  # its pull, then RELEASE, follow at once

    def flush(self, req: PrefillRequest) -> None:
        """The first token is queued to the client: what KV_READY promised may move now."""
        self.producer.flush(req.request_id)

    async def hand_over(self, req: PrefillRequest) -> Message:
        """Offer the request with its first token unless it was offered already, again while
        the decode answers NO_CAPACITY; the decode's first other answer, which the relay must
        take before anything queued after it."""
        deadline = time.monotonic() + self.cfg.handoff_timeout_s
        backoff = 0.005
        refused: set[str] = set()  # links that answered NO_CAPACITY since the last backoff
        if req.phase is Phase.QUEUED:
            await self.offer(req, req.generated[0], deadline, spin=True)
        while True:
            answer = await req.inbox.get()
            if not (isinstance(answer, Error) and self._again(req, answer.code)):
                return answer
            refused.add(req.link_id)
            if self.links.pick(frozenset(refused)) is None:  # every decode up refused it
                if time.monotonic() + backoff > deadline:
                    raise RequestFailed(
                        ErrorCode.NO_CAPACITY, f"decode has no capacity: {answer.message}"
                    )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 0.2)
                refused.clear()
            await self.link_up(deadline)
            if req.request_id not in self.allocator:
                # the lease expired meanwhile: the inbox holds the reason; never hand off
                # blocks we no longer own
                return await req.inbox.get()
            if not req.inbox.empty():  # an answer came meanwhile (the refusing link lost)
                continue
            await self.offer(req, req.generated[0], deadline, spin=True, refused=frozenset(refused))

    @staticmethod
    def _again(req: PrefillRequest, code: ErrorCode) -> bool:
        """Whether the decode's ERROR `code` sends the request to a decode again: NO_CAPACITY,
        or the link of its early offer lost before its KV was written (REFUSED either way)."""
        return req.phase is Phase.REFUSED and code in (ErrorCode.NO_CAPACITY, ErrorCode.LINK_LOST)

    def end(self, req: PrefillRequest) -> None:
        """The request ended (client gone, first token a stop, a failure, a timeout, its FINISH):
        ABORT to a decode that may hold it, written now (before the id can come again). While
        the decode may still read its blocks and wait on its event slot (LAUNCHED, LEASED) it
        goes ABORTING: both are kept (the blocks leased to the link, so a link lost or a lease
        expired frees them too) until the decode answers; the caller frees the blocks of any
        other (ENDED), and its slot is freed here. A forward that wrote those blocks for
        another prompt under the decode's pull would have it copy, and cache under this
        prompt's names, the wrong KV. The producer forgets what it held for the request (a
        NIXL PUSH), before the ABORT."""
        self.producer.forget(req.request_id)
        on = self._on.pop(req.request_id, None)
        if on is not None:
            on.load.mine -= 1
        link = self.links.by_id(req.link_id) if req.phase in _DECODE_MAY_HOLD else None
        if link is not None:
            link.post(Abort(request_id=req.request_id))
        if req.phase in _DECODE_MAY_WAIT:  # until the decode answers the ABORT
            self.producer.quarantine(req.event_slot, req.request_id, req.link_id)  # CPU: -1
            if req.request_id in self.allocator:  # not if its lease expired (freed then)
                self._lease(req)  # LAUNCHED: the blocks were still ours (KV_READY leases them)
            req.advance(Event.ABORT)
            return
        self.producer.drop_slot(req.event_slot)
        req.event_slot = -1
        req.advance(Event.END)

    def _count(self, req: PrefillRequest, link: DecodeLink) -> None:
        """`req` counts in `link`'s load from now on (in no other's)."""
        before = self._on.get(req.request_id)
        if before is link:
            return
        if before is not None:
            before.load.mine -= 1
        link.load.mine += 1
        self._on[req.request_id] = link

    def _lease(self, req: PrefillRequest) -> None:
        """The blocks to the request's link: a refused late HANDOFF's stay leased for its retry,
        and move to another link when the retry goes there (the refusing decode holds nothing)."""
        lease = self.allocator.lease_of(req.request_id)
        if lease is not None and lease.holder != req.link_id:
            self.allocator.unlease(req.request_id)
            lease = None
        if lease is None:
            lease_end = time.monotonic() + self.cfg.lease_timeout_s
            self.producer.lease(req.request_id, req.link_id, lease_end)


__all__ = ["HandoffPath"]
