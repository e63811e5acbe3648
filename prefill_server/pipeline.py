"""The life of every request in the prefill daemon, as async generators of client frames.

admit (validate, wait for blocks and an event slot) → prefill (queued to the batcher, which runs
the prompts queued meanwhile in one forward on the torch thread) → first token to the client →
hand it over (HANDOFF, retried while the decode answers NO_CAPACITY, until the handoff deadline)
→ relay TOKENS/FINISH (`_relay`; while the request's task waits for its inbox with nothing
queued and its client keeps up, the link's read callback relays its TOKENS straight to the
client instead: prefill_server/relay.py). Whatever ends the request, `finally` frees its blocks exactly
once and ends its handoff as its phase says (prefill_server.phase: ABORT to a decode that may
hold it, its event slot freed or quarantined).

The early handoff (Unix-socket links, `--early-handoff`, on by default): the HANDOFF goes out
without its first token when the prompt is queued for its forward, so the decode reads it and
reserves its blocks while we compute; once the first token is on our host (the KV is written) it
goes to the decode in KV_READY, which starts the decode's pull, then to the client. On CUDA a
plain greedy request's decode hears sooner (`--launch-early`): KV_LAUNCHED goes as soon as its
forward, its first token (into the producer's mailbox) and its slot's record are queued on the
GPU, so an idle decode queues its pull and first step behind them. The 2nd
token then waits for one small frame, the pull's enqueue and one decode step, not for the
HANDOFF's transfer and checks. A decode that answers the early HANDOFF with NO_CAPACITY gets it
again later, the first token in it.

One way down: the server hands the pipeline its collaborators (config, runtime, the Producer,
the decode links) and starts each link with the pipeline as its receiver (`deliver`,
`link_lost`); the pipeline owns the request table and never reaches back up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import structlog

from common.daemon.runtime import ModelRuntime
from common.daemon.throughput import Throughput
from common.kv.prefix_cache import PrefixCache
from common.model.sampling import finish_reason
from common.protocol import (
    Error,
    ErrorCode,
    Finish,
    Generate,
    Message,
    Release,
    StepTokens,
    Tokens,
)
from common.sampling_params import StructuredOutput
from common.structured import cached_grammar, grammars_for
from common.transfer import Producer
from prefill_server import host_tier
from prefill_server.admission import Capacity
from prefill_server.batcher import PrefillBatcher
from prefill_server.config import PrefillConfig
from prefill_server.decode_links import DecodeLinks
from prefill_server.forward import FirstToken
from prefill_server.handoff import HandoffPath
from prefill_server.output import RequestOutput
from prefill_server.phase import Event, IllegalEvent, Phase
from prefill_server.relay import Relay
from prefill_server.request import ClientSink, PrefillRequest, RequestFailed, prompt_tokens

log = structlog.get_logger(__name__)


class RequestPipeline:
    """The request table and each request's life; every DecodeLink's listener."""

    def __init__(
        self, cfg: PrefillConfig, rt: ModelRuntime, producer: Producer, links: DecodeLinks
    ) -> None:
        self.cfg = cfg
        self.rt = rt
        self.producer = producer
        self.links = links
        budget = cfg.prefill_budget(rt.device.type)
        self.batcher = PrefillBatcher(
            rt,
            producer,
            budget,
            cfg.prefill_chunk(),
            launched=self._launched,
            quiet=self._quiet,
            pipelined=cfg.pipelined(rt.device.type),
        )
        self.prefix = rt.prefix or PrefixCache(rt.allocator, rt.layout, rt.model.fingerprint, False)
        self.capacity = Capacity(rt.allocator, producer, rt.layout.block_size, self.prefix)
        self.handoff = HandoffPath(cfg, producer, links, rt.allocator)
        self.output = RequestOutput(rt.tokenizer)
        # every request we hold anything of: those in flight, and those ended while the decode
        # may read their blocks (phase ABORTING: those and their slot wait for its answer)
        self.requests: dict[str, PrefillRequest] = {}
        self.throughput = Throughput()  # finished requests and their tokens, for status
        self.relay = Relay(self.output, self.throughput)  # the decode's frames to the client
        self.stopping = False  # set by the server's shutdown: new requests are refused

    # ---- from the link ---------------------------------------------------------------------------
    def deliver(self, msg: Message) -> None:
        """A frame from the decode about a request, in the link's read callback: the event of
        the request's phase (RELEASE frees its blocks and slot; TOKENS go to its client when
        relay.py may relay them directly, else with FINISH and ERROR to its inbox; STEP_TOKENS,
        decoded once, as the TOKENS and FINISH frames it stands for, in order). A frame its
        phase cannot take is logged as an error and dropped."""
        if isinstance(msg, StepTokens):
            for each in msg.frames():
                self.deliver(each)
            return
        rid = getattr(msg, "request_id", None)
        req = self.requests.get(rid) if rid else None
        if req is not None and req.phase is Phase.ABORTING:
            self._abort_answered(req, msg)
            return
        if req is None:
            if isinstance(msg, Release):
                self._late_release(msg.event_slot, msg.request_id)
            elif not isinstance(msg, Finish | Tokens):
                log.warning("link_message_for_unknown_request", type=msg.TYPE.name, request_id=rid)
            return
        try:
            self._answer(req, msg)
        except IllegalEvent as exc:
            log.error(
                "decode_frame_out_of_phase",
                request_id=rid,
                type=msg.TYPE.name,
                phase=exc.phase.name,
                error=str(exc),
            )
            if isinstance(msg, Release):
                self._late_release(msg.event_slot, msg.request_id)

    def _answer(self, req: PrefillRequest, msg: Message) -> None:
        """The decode's frame as the event of `req`'s phase; IllegalEvent if it cannot take it
        (then nothing changed)."""
        if isinstance(msg, Release):
            if 0 <= req.event_slot != msg.event_slot:  # not this request's slot: not its RELEASE
                log.warning(
                    "release_names_another_slot",
                    request_id=req.request_id,
                    slot=msg.event_slot,
                    expected=req.event_slot,
                )
                self._late_release(msg.event_slot, msg.request_id)
                return
            req.advance(Event.RELEASE)
            # False: its lease expired meanwhile (the slot is dropped when the request ends)
            if self.producer.released(req.request_id, req.event_slot):
                req.marks.stamp("released")
                req.event_slot = -1
                self.capacity.changed()
            return
        if isinstance(msg, Error):
            req.advance(Event.NO_CAPACITY if msg.code == ErrorCode.NO_CAPACITY else Event.ERROR)
        elif isinstance(msg, Tokens):
            req.advance(Event.TOKENS)
            if self.relay.direct(req, msg):  # relay.py: from here, when nothing can overtake
                return
            self.relay.counts["queued"] += 1
        elif isinstance(msg, Finish):
            req.advance(Event.FINISH)
        else:
            log.warning("link_message_unexpected", type=msg.TYPE.name, request_id=req.request_id)
            return
        req.inbox.put_nowait(msg)

    def _abort_answered(self, req: PrefillRequest, msg: Message) -> None:
        """The decode's RELEASE (naming the slot) or ERROR for an ABORTING request frees its
        blocks (unless its lease expired meanwhile) and quarantined slot; its other frames were
        on their way before the ABORT."""
        if isinstance(msg, Release) and msg.event_slot != req.event_slot:
            self._late_release(msg.event_slot, req.request_id)
        elif isinstance(msg, Release | Error):
            req.advance(Event.ABORT_ANSWERED)
            del self.requests[req.request_id]
            if req.request_id in self.rt.allocator:
                self.rt.allocator.free(req.request_id)
            self._late_release(req.event_slot, req.request_id)
            self.capacity.changed()

    def _late_release(self, slot: int, request_id: str) -> None:
        """The decode's RELEASE (or answer to the ABORT) for `request_id`, gone or ending: the
        slot quarantined for that request may be recorded again (one quarantined for another
        request stays so)."""
        if self.producer.ack_late(slot, request_id):
            self.capacity.changed()

    def link_lost(self, link_id: str, reason: str) -> None:
        """The link ended: its leases are freed, its handed-off requests fail with LINK_LOST;
        one offered early whose KV is not written yet (no token of it left the daemons) goes
        to another decode after its forward instead (REFUSED; the blocks of a forward not run
        yet are not leased: they stay its own)."""
        freed = self.producer.link_lost(link_id)  # its leases (and quarantined slots) too
        for rid, req in list(self.requests.items()):
            if req.link_id == link_id and req.phase is Phase.ABORTING:
                req.advance(Event.LINK_LOST)  # its blocks were leased to the link: freed above
                del self.requests[rid]
        for req in self.requests.values():
            if req.link_id == link_id and req.accepts(Event.LINK_LOST):
                req.advance(Event.LINK_LOST)  # an early offer: REFUSED, offered again
                req.inbox.put_nowait(
                    Error(code=ErrorCode.LINK_LOST, message=f"link to decode lost: {reason}")
                )
        if freed:
            log.warning("leases_reclaimed", link=link_id, requests=len(freed))
        self.capacity.changed()

    async def reap_leases(self) -> None:
        """Forever: free leases the decode did not release within lease_timeout_s (an ABORTING
        request's, whose ABORT got no answer, ends with its slot freed)."""
        while True:
            await asyncio.sleep(min(1.0, self.cfg.lease_timeout_s / 4))
            for rid in self.producer.expired(time.monotonic()):
                log.warning("lease_expired", request_id=rid)
                req = self.requests.get(rid)
                if req is not None and req.phase is Phase.ABORTING:
                    # its ABORT got no answer in time: its slot goes back too (as its blocks
                    # did, and as both would if the link ended), and its id may come again
                    req.advance(Event.LEASE_EXPIRED)
                    del self.requests[rid]
                    self._late_release(req.event_slot, rid)
                elif req is not None:
                    req.inbox.put_nowait(
                        Error(code=ErrorCode.WAIT_TIMEOUT, message="decode did not release in time")
                    )
                self.capacity.changed()

    def shut_down(self) -> None:
        """Every request still in flight ends with SHUTTING_DOWN."""
        for req in self.live():
            req.inbox.put_nowait(
                Error(code=ErrorCode.SHUTTING_DOWN, message="prefill daemon is shutting down")
            )

    def _quiet(self, request_ids: list[str]) -> bool:
        """Whether these requests (one forward's) are all we have in flight: their decode then
        has nothing else of ours to decode, and a KV_LAUNCHED lets it start their first step
        behind the forward. Under load nothing is launched early (no frames, no waits)."""
        live = {req.request_id for req in self.live()}
        return len(live) <= len(request_ids) and live <= set(request_ids)

    def live(self) -> list[PrefillRequest]:
        """The requests in flight: all we hold but those ended and ABORTING."""
        return [req for req in self.requests.values() if req.phase is not Phase.ABORTING]

    def _launched(self, request_ids: list[str], queued_ns: int) -> None:
        """The batcher queued these requests' forwards, first tokens (mailbox) and slot records
        on the GPU at `queued_ns`: KV_LAUNCHED to the decode of each still offered early (and
        not answered)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                req.marks.stamp("launch_queued", queued_ns)
                self.handoff.launched(req)

    # ---- one request -----------------------------------------------------------------------------
    async def run(
        self, rid: str, msg: Generate, sink: ClientSink | None = None, read_ns: int = 0
    ) -> AsyncIterator[Tokens | Finish]:
        """The request's frames to its client, in order, FINISH last; RequestFailed to end it
        with ERROR. With `sink` (the client's writer, where the consumer sends what this
        yields) its relayed TOKENS may go there directly instead (relay.py). `read_ns`:
        when its GENERATE was read (monotonic ns; 0: not known)."""
        req = self._admit(rid, msg)
        req.marks.stamp("read", read_ns)
        req.sink = sink
        self.requests[rid] = req
        timeout_s = self.cfg.handoff_timeout_s
        try:
            if (spec := req.sampling.structured) is not None:  # GrammarError: BAD_REQUEST
                await self._compile(spec)  # before any block
            await self.handoff.link_up(time.monotonic() + timeout_s)
            req.names = self.prefix.names(req.prompt_tokens)
            n = len(req.prompt_tokens)
            # prompt logprobs want the logits at every position: no cached prefix (nor chunks,
            # the batcher's side), the whole prompt is computed; its blocks are named after all
            lookup = req.sampling.prompt_logprobs is None
            req.blocks, hit = await self.capacity.blocks(
                rid, n, timeout_s, req.names, lookup=lookup
            )
            if lookup and self.rt.host_tier is not None:  # past the pool's cache: the host tier
                hit += await host_tier.restore(self.rt.host_tier, req, hit)
            req.cached_tokens = hit * self.rt.layout.block_size
            req.event_slot = await self.capacity.slot(timeout_s)
            answer, shared = await self._prefill(req)
            req.marks.stamp("first_token")
            for frame in self.output.prompt_logprobs(req, answer.prompt_logprobs):
                yield frame
            if (first := answer.token) is None:  # max_tokens 0: the prompt scored, no token
                yield self.relay.finish(req, "length", {})
                return
            req.generated.append(first)
            stops = self.rt.model.config.stop_token_ids
            reason = (
                "stop" if answer.complete else finish_reason(req.generated, req.sampling, stops)
            )
            if not reason:
                await self.handoff.ready(req, first)  # after an early HANDOFF: KV_READY
            yield self.output.tokens(
                req, [first], None if answer.logprob is None else [answer.logprob]
            )
            req.marks.stamp("first_out")  # resumed: the consumer has queued it to the client
            self.handoff.flush(req)  # a TCP push link: the WRITE that KV_READY announced
            if reason:  # nothing left to decode (an early HANDOFF is aborted as it ends)
                yield self.relay.finish(req, reason, {})
                return
            if shared > 1:  # the batch-mates' first tokens go to their clients before this HANDOFF
                await asyncio.sleep(0)
            first_answer = await self.handoff.hand_over(req)
            async for out in self.relay.stream(req, first_answer):
                yield out
        finally:
            self._cleanup(req)

    async def _compile(self, spec: StructuredOutput) -> None:
        """A constrained request's grammar compiled (GrammarError when it does not): a cached
        one found on the loop, a new one compiled off it (~1 ms), as is the cache itself while
        its tokenizer's view is still being built (common.structured.warm)."""
        config = self.rt.model.config
        tok, vocab, eos = self.rt.tokenizer, config.vocab_size, config.stop_token_ids
        if cached_grammar(tok, vocab, eos, spec) is None:
            await asyncio.to_thread(lambda: grammars_for(tok, vocab, eos).compile(spec))

    def _admit(self, rid: str, msg: Generate) -> PrefillRequest:
        """The request, if it may start: RequestFailed saying why not otherwise."""
        if self.stopping:
            raise RequestFailed(ErrorCode.SHUTTING_DOWN, "prefill daemon is shutting down")
        if rid in self.requests:
            raise RequestFailed(ErrorCode.BAD_REQUEST, f"request id {rid} is already in flight")
        if (in_flight := len(self.live())) >= self.cfg.max_pending:
            raise RequestFailed(
                ErrorCode.NO_CAPACITY,
                f"{in_flight} requests in flight, the limit is {self.cfg.max_pending} "
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
        return PrefillRequest(rid, prompt, sampling, stream=msg.stream)

    async def _prefill(self, req: PrefillRequest) -> tuple[FirstToken, int]:
        """Its forward (queued to the batcher; the early HANDOFF goes out meanwhile): its first
        token and the number of requests in that forward. Its blocks are named in the prefix
        cache once written, not before."""
        req.marks.stamp("queued")
        future = self.batcher.submit(
            req.request_id,
            req.prompt_tokens,
            req.blocks,
            req.sampling,
            req.event_slot,
            req.cached_tokens,
            req.marks,
        )
        req.advance(Event.QUEUE)
        try:
            early = self.cfg.early_handoff and self.producer.caps.early_handoff
            if early and req.sampling.max_tokens > 1:
                await asyncio.sleep(0)  # the batcher starts the forward first, then this goes
                deadline = time.monotonic() + self.cfg.handoff_timeout_s
                await self.handoff.offer(req, None, deadline)  # during the forward
            self.prefix.complete(req.names)  # its blocks' names, while the forward runs
            result = await future
            self.prefix.publish(req.request_id, req.names)
            if self.rt.host_tier is not None:  # written through, ahead of any reuse of its blocks
                host_tier.write_through(self.rt, req)
            return result
        finally:
            future.cancel()  # the request went away while queued: skip its prompt

    def _cleanup(self, req: PrefillRequest) -> None:
        rid = req.request_id
        self.handoff.flush(req)  # a WRITE its KV_READY announced reads the blocks while leased
        self.handoff.end(req)
        if req.phase is Phase.ABORTING:  # its blocks stay leased until the decode answers
            self.capacity.changed()
            return
        if rid in self.rt.allocator:
            self.rt.allocator.free(rid)
        if self.requests.get(rid) is req:
            del self.requests[rid]
        self.capacity.changed()
