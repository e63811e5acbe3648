"""The life of every request in the prefill daemon, as async generators of client frames.

admit (validate, wait for blocks and an event slot) → prefill (queued to the batcher, which runs
the prompts queued meanwhile in one forward on the torch thread) → first token to the client →
lease the blocks to the link and HANDOFF (retried while the decode answers NO_CAPACITY, until the
handoff deadline) → relay TOKENS/FINISH. Whatever ends the request, `finally` frees its blocks exactly once
and an unfinished handoff is aborted on the decode side.

The early handoff (Unix-socket links, `--early-handoff`, on by default): the HANDOFF goes out
without its first token when the prompt is queued for its forward, so the decode reads it and
reserves its blocks while we compute; once the first token is on our host (the KV is written) it
goes to the decode in KV_READY, which starts the decode's pull, then to the client. The 2nd
token then waits for one small frame, the pull's enqueue and one decode step, not for the
HANDOFF's transfer and checks. A decode that answers the early HANDOFF with NO_CAPACITY gets it
again later, the first token in it.

One way down: the server hands the pipeline its collaborators (config, runtime, the KVProducer,
the link) and the link's frames (`deliver`, `link_lost`); the pipeline owns the request table and
never reaches back up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import structlog

from common.config import PrefillConfig
from common.model.paged import blocks_for
from common.model.sampling import finish_reason
from common.modelrt import ModelRuntime
from common.protocol import (
    Abort,
    Error,
    ErrorCode,
    Finish,
    Generate,
    Handoff,
    KvReady,
    Message,
    Release,
    Tokens,
)
from common.throughput import Throughput
from common.transfer import KVProducer
from prefill_server.batcher import PrefillBatcher
from prefill_server.link import DecodeLink
from prefill_server.output import RequestOutput
from prefill_server.request import PrefillRequest, RequestFailed, prompt_tokens

log = structlog.get_logger(__name__)


class RequestPipeline:
    def __init__(
        self, cfg: PrefillConfig, rt: ModelRuntime, producer: KVProducer, link: DecodeLink
    ) -> None:
        self.cfg = cfg
        self.rt = rt
        self.producer = producer
        self.link = link
        self.batcher = PrefillBatcher(rt, producer, cfg.prefill_budget(rt.device.type))
        self.output = RequestOutput(rt.tokenizer)
        self.requests: dict[str, PrefillRequest] = {}
        self.throughput = Throughput()  # finished requests and their tokens, for status
        self.stopping = False  # set by the server's shutdown: new requests are refused
        self._freed = asyncio.Event()
        # aborted requests whose event slot waits in quarantine for the decode's answer to the
        # ABORT (RELEASE, or CACHE_NOT_EXIST when it held nothing): request id -> slot
        self._aborting: dict[str, int] = {}

    def capacity_changed(self) -> None:
        """Wake every request waiting for blocks or an event slot."""
        self._freed.set()
        self._freed = asyncio.Event()

    # ---- from the link ---------------------------------------------------------------------------
    def deliver(self, msg: Message) -> None:
        """A frame from the decode about a request: RELEASE frees its blocks (and slot), the
        rest goes to the request's inbox. Called in the link's read callback."""
        rid = getattr(msg, "request_id", None)
        req = self.requests.get(rid) if rid else None
        if isinstance(msg, Release) and (
            req is None
            or not req.leased  # its blocks are not the decode's to release (an id reused)
            or 0 <= req.event_slot != msg.event_slot  # another request's slot: an id reused
        ):
            if self._aborting.get(rid) == msg.event_slot:
                del self._aborting[rid]
            if self.producer.ack_late(msg.event_slot):
                self.capacity_changed()
            return
        if req is None:
            if isinstance(msg, Error) and rid in self._aborting:  # it held nothing to release
                if self.producer.ack_late(self._aborting.pop(rid)):
                    self.capacity_changed()
            elif not isinstance(msg, Finish | Tokens):
                log.warning("link_message_for_unknown_request", type=msg.TYPE.name, request_id=rid)
            return
        if not isinstance(msg, Release):
            if isinstance(msg, Error | Finish):
                req.held = False  # the decode holds nothing of it any more
            req.inbox.put_nowait(msg)
        elif not req.released and self.producer.released(req.request_id, req.event_slot):
            req.released = True
            req.handoff_us = (time.monotonic_ns() - (req.kv_ready_ns or req.handoff_sent_ns)) / 1000
            req.event_slot = -1
            self.capacity_changed()

    def link_lost(self, link_id: str, reason: str) -> None:
        """The link ended: its leases are freed, its handed-off requests fail with LINK_LOST
        (the blocks of one whose forward has not run yet are not leased: they stay its own
        until its forward is done, and are freed then)."""
        freed = self.producer.link_lost(link_id)  # its quarantined slots too
        self._aborting.clear()
        for req in self.requests.values():
            if req.handed_off and req.link_id == link_id:
                req.held = False
                req.inbox.put_nowait(
                    Error(code=ErrorCode.LINK_LOST, message=f"link to decode lost: {reason}")
                )
        if freed:
            log.warning("leases_reclaimed", link=link_id, requests=len(freed))
        self.capacity_changed()

    async def reap_leases(self) -> None:
        """Forever: free leases the decode did not release within lease_timeout_s."""
        while True:
            await asyncio.sleep(min(1.0, self.cfg.lease_timeout_s / 4))
            for rid in self.producer.expired(time.monotonic()):
                log.warning("lease_expired", request_id=rid)
                req = self.requests.get(rid)
                if req is not None:
                    req.inbox.put_nowait(
                        Error(code=ErrorCode.WAIT_TIMEOUT, message="decode did not release in time")
                    )
                self.capacity_changed()

    def shut_down(self) -> None:
        """Every request still in flight ends with SHUTTING_DOWN."""
        for req in list(self.requests.values()):
            req.inbox.put_nowait(
                Error(code=ErrorCode.SHUTTING_DOWN, message="prefill daemon is shutting down")
            )

    # ---- one request -----------------------------------------------------------------------------
    async def run(self, rid: str, msg: Generate) -> AsyncIterator[Tokens | Finish]:
        if self.stopping:
            raise RequestFailed(ErrorCode.SHUTTING_DOWN, "prefill daemon is shutting down")
        if rid in self.requests or rid in self._aborting:
            raise RequestFailed(ErrorCode.BAD_REQUEST, f"request id {rid} is already in flight")
        if len(self.requests) >= self.cfg.max_pending:
            raise RequestFailed(
                ErrorCode.NO_CAPACITY,
                f"{len(self.requests)} requests in flight, the limit is {self.cfg.max_pending} "
                "(retry later, or raise --max-pending)",
            )
        config = self.rt.model.config
        prompt = prompt_tokens(
            msg,
            self.rt.tokenizer,
            config.vocab_size,
            self.cfg.max_prompt_tokens,
            max_positions=config.max_position_embeddings,
        )
        sampling = msg.sampling.validate().with_seed()
        req = PrefillRequest(rid, prompt, sampling, stream=msg.stream)
        self.requests[rid] = req
        rt = self.rt
        try:
            await self._link_up(time.monotonic() + self.cfg.handoff_timeout_s)
            blocks = await self._allocate(req)
            await self._acquire_slot(req, time.monotonic() + self.cfg.handoff_timeout_s)
            future = self.batcher.submit(rid, prompt, blocks, sampling, req.event_slot)
            try:
                if self.cfg.early_handoff and self.link.tcp is None and sampling.max_tokens > 1:
                    deadline = time.monotonic() + self.cfg.handoff_timeout_s
                    await self._send_handoff(req, blocks, None, deadline)  # during the forward
                first, shared = await future
            finally:
                future.cancel()  # the request went away while queued: skip its prompt
            req.generated.append(first)
            req.first_ns = time.monotonic_ns()
            req.ttft_ms = (req.first_ns / 1e9 - req.arrived) * 1000
            reason = finish_reason(req.generated, sampling, rt.model.config.stop_token_ids)
            if req.handed_off and not reason and req.inbox.empty():
                await self._send_first(req, first)  # the decode's sequence joins its batch
            yield self.output.tokens(req, [first])
            if reason:  # nothing left to decode (an early HANDOFF is aborted by _cleanup)
                yield self._finish(req, reason, {})
                return
            if shared > 1:  # the batch-mates' first tokens go to their clients before this HANDOFF
                await asyncio.sleep(0)
            first_answer = await self._handoff(req, blocks)
            async for out in self._relay(req, first_answer):
                yield out
        finally:
            self._cleanup(req)

    async def _link_up(self, deadline: float) -> None:
        """LINK_LOST unless the link is up or comes up at the next connection attempt: no
        prefill work for a request that cannot be handed off."""
        try:
            await self.link.wait_up(deadline - time.monotonic())
        except ConnectionError as exc:
            raise RequestFailed(ErrorCode.LINK_LOST, str(exc)) from None

    async def _wait_capacity(self, deadline: float) -> bool:
        """Wait until capacity changes or `deadline`; False once the deadline has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(left):
                await self._freed.wait()
        return True

    async def _allocate(self, req: PrefillRequest) -> list[int]:
        alloc = self.rt.allocator
        need = blocks_for(len(req.prompt_tokens), self.rt.layout.block_size)
        if need > alloc.total:
            raise RequestFailed(
                ErrorCode.BAD_REQUEST,
                f"prompt needs {need} blocks, the pool has {alloc.total} (raise --num-blocks)",
            )
        deadline = time.monotonic() + self.cfg.handoff_timeout_s
        while not alloc.can_allocate(need):
            if not await self._wait_capacity(deadline):
                raise RequestFailed(
                    ErrorCode.NO_CAPACITY,
                    f"no {need} free KV blocks within {self.cfg.handoff_timeout_s}s "
                    f"({alloc.num_free} free of {alloc.total})",
                )
        return alloc.allocate(req.request_id, need)

    async def _acquire_slot(self, req: PrefillRequest, deadline: float) -> None:
        while (slot := self.producer.acquire_slot()) is None:
            if not await self._wait_capacity(deadline):
                raise RequestFailed(
                    ErrorCode.NO_CAPACITY,
                    f"all {self.producer.event_slots} handoff event slots busy",
                )
        req.event_slot = slot

    async def _handoff(self, req: PrefillRequest, blocks: list[int]) -> Message:
        """Send HANDOFF unless it went early (again, with the first token, while the decode
        answers NO_CAPACITY); the decode's first other answer for this request, which the relay
        must take before anything queued after it."""
        deadline = time.monotonic() + self.cfg.handoff_timeout_s
        backoff = 0.005
        if not req.handed_off:
            await self._send_handoff(req, blocks, req.generated[0], deadline, spin=True)
        while True:
            first = await req.inbox.get()
            if not (isinstance(first, Error) and first.code == ErrorCode.NO_CAPACITY):
                return first
            if time.monotonic() + backoff > deadline:
                raise RequestFailed(
                    ErrorCode.NO_CAPACITY, f"decode has no capacity: {first.message}"
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.2)
            await self._link_up(deadline)
            if not req.inbox.empty() or req.request_id not in self.rt.allocator:
                # the link was lost or the lease expired meanwhile: the inbox holds the reason;
                # never hand off blocks we no longer own
                return await req.inbox.get()
            if req.link_id != self.link.link_id:  # nor to a link that never heard of them
                raise RequestFailed(ErrorCode.LINK_LOST, "link to decode lost during the retry")
            await self._send_handoff(req, blocks, req.generated[0], deadline, spin=True)

    async def _send_handoff(
        self,
        req: PrefillRequest,
        blocks: list[int],
        first_token: int | None,
        deadline: float,
        *,
        spin: bool = False,
    ) -> None:
        """Send the HANDOFF on the live link, and with the first token lease the blocks to it
        (once); `first_token` None is the early handoff, whose blocks are leased when its
        KV_READY goes (their KV written). LINK_LOST if the link is down past `deadline` or the
        send fails."""
        await self._link_up(deadline)
        link = self.link
        req.handed_off, req.held, req.link_id = True, True, link.link_id
        req.handoff_sent_ns = time.monotonic_ns()
        if first_token is not None:  # the decode may read the blocks from now on
            self._lease(req)
            req.kv_ready_ns = req.handoff_sent_ns
        handoff = Handoff(
            request_id=req.request_id,
            block_ids=blocks,
            num_tokens=len(req.prompt_tokens),
            prompt_tokens=req.prompt_tokens,
            first_token=first_token,
            sampling=req.sampling,
            event_slot=req.event_slot,
            sent_ns=req.handoff_sent_ns,
        )
        try:
            await link.send(handoff, spin=spin)
        except ConnectionError as exc:
            # the frame did not get through whole, so the decode cannot act on it: the
            # blocks and the event slot are ours again (freed by _cleanup, not quarantined)
            req.handed_off = req.held = False
            req.kv_ready_ns = 0
            raise RequestFailed(ErrorCode.LINK_LOST, str(exc)) from None

    def _lease(self, req: PrefillRequest) -> None:
        if not req.leased:
            lease_end = time.monotonic() + self.cfg.lease_timeout_s
            self.producer.lease(req.request_id, req.link_id, lease_end)
            req.leased = True

    async def _send_first(self, req: PrefillRequest, first: int) -> None:
        """After an early HANDOFF: its first token to the decode, on the link that has the
        HANDOFF. A lost link is the relay's to report (LINK_LOST, from link_lost)."""
        if not (self.link.ready.is_set() and self.link.link_id == req.link_id):
            return
        self._lease(req)
        req.kv_ready_ns = time.monotonic_ns()  # the decode's pull starts on this frame
        msg = KvReady(request_id=req.request_id, first_token=first, sent_ns=req.kv_ready_ns)
        with contextlib.suppress(ConnectionError):
            await self.link.send(msg, spin=True)  # its pull, then RELEASE, follow at once

    async def _relay(self, req: PrefillRequest, first: Message) -> AsyncIterator[Tokens | Finish]:
        msg = first
        while True:
            if isinstance(msg, Tokens):
                req.generated.extend(msg.tokens)
                yield self.output.tokens(req, msg.tokens)
            elif isinstance(msg, Finish):
                yield self._finish(req, msg.reason, msg.timings)
                return
            elif isinstance(msg, Error):
                raise RequestFailed(msg.code, msg.message)
            msg = await req.inbox.get()

    def _finish(self, req: PrefillRequest, reason: str, decode_timings: dict[str, float]) -> Finish:
        self.throughput.add(len(req.generated), requests=1)
        return self.output.finish(req, reason, decode_timings)

    def _cleanup(self, req: PrefillRequest) -> None:
        rid = req.request_id
        if rid in self.rt.allocator:
            self.rt.allocator.free(rid)
        link = self.link
        abort = req.held and link.ready.is_set() and link.link_id == req.link_id
        if abort:  # the request ended (client gone, first token a stop, a failure, a timeout)
            link.post(Abort(request_id=rid))  # written now: before the id can come again
        if req.event_slot >= 0:
            if abort and req.kv_ready_ns:  # the decode may wait on it: until it answers
                self.producer.quarantine(req.event_slot)
                self._aborting[rid] = req.event_slot
            else:  # it never waited on the slot (no KV was offered) or answered already
                self.producer.drop_slot(req.event_slot)
            req.event_slot = -1
        if self.requests.get(rid) is req:
            del self.requests[rid]
        self.capacity_changed()
