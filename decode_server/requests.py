"""The decode daemon's requests across all links: one table of sequences keyed by (link, request
id), each in one phase (`Sequence.phase`), moved only by the event methods below.

    HANDOFF ─┬─ early: no first token ──► AWAITING_KV ── KV_READY ──┐
             └─ with its first token ────────────────────────────┴──► its pull starts: PULLING
    AWAITING_KV ── KV_LAUNCHED, nothing else to decode ──► its pull starts (first_pending)
    first_pending DECODING ── KV_READY: its first token, its RELEASE if due ──► DECODING
    PULLING ── the start returned a stream-ordered pull (CUDA) ──► DECODING, pull outstanding
    PULLING ── pull done: RELEASE ─┬─► DECODING  (CPU: inside the start; NIXL: later)
                                   └─► FINISH, ENDING  (its first token finished it)
    DECODING ── step: its token (STEP_TOKENS) ──► DECODING;   pull done: RELEASE ──► DECODING
    DECODING ── step: its token + FINISH, or ERROR NUMERIC_ERROR ──► ENDING
    AWAITING_KV, PULLING, DECODING ── ABORT, link lost (nothing sent), shutdown (ERROR), pull
        failed (ERROR INTERNAL), a first token past the vocabulary (ERROR BAD_REQUEST) ──► ENDING
    ENDING ── pull done: RELEASE;  no pull outstanding and no step in flight ──► blocks freed,
        out of the table

`pull_outstanding` is the one fact beside the phase: a started pull's `done` has not run yet, so
its RELEASE is still due and the copy may still write the sequence's blocks (or an ended
AWAITING_KV sequence's early NIXL push may still land in them: no RELEASE is due for it). A sequence holds
its blocks from HANDOFF until it leaves the table: an ENDING one keeps them while its pull or a
step in flight may still touch them (a new pull into them would not be ordered after either).
An event that is illegal in a sequence's phase is logged (`event_out_of_phase`, with the
request id and the phase) and answered only where docs/protocol.md says so.

`run()` is the decode loop: the engine steps, and each step's results are the step event.

KV_LAUNCHED (v12, CUDA): the prefill has queued the forward, the first token (into its mailbox)
and the event slot's record on its GPU, and KV_READY follows once its host has the token. A
plain sequence that arrives while nothing else is to be decoded (no step running, launched or
queued) starts its pull then, behind the slot, with the mailbox entry copied into
`_first_token` by the same pull, and joins the batch: its first step is launched ahead
(overlap), its input token taken from `_first_token` on the GPU, so the 2nd token does not wait
for our host's work after the forward. That step's result is read only once KV_READY has given
the host the first token (`_first_tokens`), and its RELEASE waits for KV_READY too (the
prefill's phase takes none before). After KV_LAUNCHED an ABORT is answered with RELEASE (the
prefill keeps the slot from reuse until then), whether or not the pull started on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from logging import ERROR, INFO, WARNING
from typing import Any

import structlog
import torch

from common.daemon.runtime import ModelRuntime
from common.daemon.throughput import Throughput
from common.errors import OutOfBlocks
from common.protocol import ErrorCode, Handoff, KvLaunched, KvReady, Release, make_error
from common.transfer.interface import AFTER_DONE, PullDone
from decode_server.admission import admit
from decode_server.answers import Outbox, finish, out_of_phase
from decode_server.engine import DecodeEngine
from decode_server.peer import Peer
from decode_server.prefill_first import PrefillFirst
from decode_server.sequence import Phase, Sequence, seq_key

log = structlog.get_logger(__name__)
BAD_REQUEST, CACHE_NOT_EXIST = ErrorCode.BAD_REQUEST, ErrorCode.CACHE_NOT_EXIST
StartPull = Callable[[PullDone], Any]  # starts a pull with its `done`: what a reader waits on
#: how long a step launched on KV_LAUNCHED waits to be read for its KV_READY (which follows the
#: prefill forward's host sync) before that sequence is failed and the batch goes on
FIRST_TOKEN_WAIT_S = 10.0


class DecodeRequests:
    def __init__(
        self,
        rt: ModelRuntime,
        *,
        max_batch: int,
        overlap: str = "off",
        warm_wait: bool = False,
        prefill_first_ms: float = 0.0,
    ) -> None:
        self.rt = rt
        self.overlap = overlap  # --overlap-steps as resolved: "on", "always" or "off"
        hold = self._prefilling if overlap == "on" else None
        expecting = self._prefilling if warm_wait else None  # --warm-wait (warm.py)
        self.engine = DecodeEngine(
            rt, max_batch=max_batch, overlap=overlap != "off", hold=hold, expecting=expecting
        )
        # --prefill-first-ms (prefill_first.py): hold a step while a prefill computes our prompts
        self.prefill_first = PrefillFirst(prefill_first_ms) if prefill_first_ms > 0 else None
        self.vocab_size = rt.model.config.vocab_size
        self._stop_ids = rt.model.config.stop_token_ids  # a property that builds a set: once
        self._table: dict[str, Sequence] = {}  # seq_key(link, request id) -> its sequence
        self._stepping = False  # a decode step is in flight (run)
        self._ended_in_step = False  # a sequence went ENDING during it: free after it
        self.handoffs = 0
        self.throughput = Throughput()  # tokens decoded, sequences finished: for status
        self._yield_after_release = rt.device.type == "cpu"
        # KV_LAUNCHED: where a launched sequence's pull puts its first token (one at a time:
        # only a sequence that finds nothing else to decode is launched so)
        self._first_token = None
        if rt.device.type == "cuda" and overlap != "off":
            self._first_token = torch.zeros(1, dtype=torch.int64, device=rt.device)
        self._first_known = asyncio.Event()  # a KV_READY for a launched sequence, or its end
        self._last_launched: Sequence | None = None  # its pull writes `_first_token`
        self.launched_first = 0  # sequences whose pull and first step started on KV_LAUNCHED

    def __len__(self) -> int:
        return len(self.engine)  # DECODING: in the batch or queued for it

    def sequences(self) -> list[Sequence]:
        """Every live sequence (not ENDING): awaiting its KV, pulling it, or decoding."""
        return [s for s in self._table.values() if s.phase is not Phase.ENDING]

    def _prefilling(self) -> bool:
        """Whether a prefill computes a prompt it handed to us early (a sequence awaits its
        KV): --overlap-steps on launches no step ahead meanwhile, leaving the GPU's gaps
        between steps to that forward."""
        return any(s.phase is Phase.AWAITING_KV for s in self._table.values())

    def _awaiting_kv(self) -> list[str]:
        """The keys of the sequences handed to us early whose KV a prefill on our own device
        still computes (a prefill on another GPU or host does not take turns with our steps)."""
        return [
            k
            for k, s in self._table.items()
            if s.phase is Phase.AWAITING_KV
            and s.link.consumer is not None
            and s.link.consumer.shares_device
        ]

    def awaits_kv(self, peer: Peer) -> bool:
        """Whether the loop has nothing to step and a sequence of `peer`'s awaits its KV: while
        so, the link may be polled for that KV_READY (server.py) without taking the CPU from a
        step."""
        if self._stepping or len(self.engine) or self.engine.ahead:
            return False
        return any(s.link is peer and s.phase is Phase.AWAITING_KV for s in self._table.values())

    def phase(self, link_id: str, request_id: str) -> Phase | None:
        """Where the request is; None once the decode holds nothing of it."""
        seq = self._table.get(seq_key(link_id, request_id))
        return None if seq is None else seq.phase

    async def run(self) -> None:
        """The decode loop: step while there is work, answer each step's sequences. Ends only
        when cancelled; a failing step raises (nothing here can decode any more)."""
        try:
            while True:
                await self.engine.wait_for_work()
                launching = self.engine.launching
                if self.prefill_first is not None and not self.engine.ahead and not launching:
                    await self.prefill_first.hold(self._awaiting_kv)
                await self._first_tokens()
                self._stepping = True
                try:
                    results = await self.engine.step()
                finally:
                    self._stepping = False
                    self._free_ended()
                self.step_done(results)  # no sleep(0) after: every step suspends in rt.run,
                # and link traffic (a HANDOFF joining the next step) is handled meanwhile
        finally:
            self._stepping = False
            self.engine.settle()  # a step launched ahead may still write its sequences' K/V
            self._free_ended()

    async def _first_tokens(self) -> None:
        """Before the step ahead is read: every sequence in it that was launched on KV_LAUNCHED
        has its first token on the host (KV_READY) or has ended. One whose KV_READY does not
        come within FIRST_TOKEN_WAIT_S fails (ERROR INTERNAL) and the rest go on."""
        while pending := self.engine.first_pending():
            self._first_known.clear()
            try:
                await asyncio.wait_for(self._first_known.wait(), FIRST_TOKEN_WAIT_S)
            except TimeoutError:
                for seq in pending:
                    if seq.first_pending and seq.phase is not Phase.ENDING:
                        why = f"no KV_READY within {FIRST_TOKEN_WAIT_S:g} s of KV_LAUNCHED"
                        seq.link.post_error(ErrorCode.INTERNAL, why, seq.request_id)
                        self._end(seq)

    # ---- events ----------------------------------------------------------------------------------
    def warm_pull(self, peer: Peer) -> None:
        """A new link: one pull through it into a scratch block (Consumer.warm), so its
        first-time costs fall now, not on its first request. Best effort: a full pool or a
        failure only skips it (logged)."""
        consumer, alloc = peer.consumer, self.rt.allocator
        owner = f"warm-pull@{peer.link_id}"  # no sequence key: those are LINK/REQUEST
        if consumer is None:
            return
        try:
            (scratch,) = alloc.allocate(owner, 1)
        except OutOfBlocks:
            return
        started = time.perf_counter()

        def done(exc: BaseException | None) -> None:
            alloc.free(owner)
            ms = round((time.perf_counter() - started) * 1e3, 3)
            if exc is None:
                log.info("link_warm_pull_done", link=peer.link_id, ms=ms)
            else:
                log.warning("link_warm_pull_failed", link=peer.link_id, error=str(exc), ms=ms)

        try:
            warmed = consumer.warm(scratch, done)
        except Exception as exc:  # never worth a link: the first request pays instead
            log.warning("link_warm_pull_failed", link=peer.link_id, error=str(exc))
            warmed = False
        if not warmed:
            alloc.free(owner)

    def handoff(self, peer: Peer, h: Handoff) -> None:
        """HANDOFF: check it and reserve blocks for the request's whole life (or answer
        BAD_REQUEST / NO_CAPACITY); early (no first token): AWAITING_KV with its pull planned;
        else the pull starts."""
        read = time.monotonic_ns()
        held = self._table.get(seq_key(peer.link_id, h.request_id))
        if held is not None:
            why = "request id already in flight on this link"
            out_of_phase("HANDOFF", peer, h.request_id, held.phase, answer=(BAD_REQUEST, why))
            return
        seq = admit(self.rt, peer, h, self._stop_ids)
        if seq is None:
            return
        self._table[seq.key] = seq
        marks = seq.marks
        marks.stamp("handoff_read", read)
        marks.stamp("admitted")
        if marks.stamp("handoff_sent", h.sent_ns):  # P's clock: same host only
            marks.stamp("handoff_rx", int(peer.channel.last_rx * 1e9))
        hit = seq.cached_blocks  # those are in our pool already: the pull copies the rest
        log.debug(
            "handoff_accepted",
            request_id=h.request_id,
            link=peer.link_id,
            blocks=len(h.block_ids),
            cached=hit,
        )
        consumer, src, dst = peer.consumer, h.block_ids[hit:], seq.blocks[hit : len(h.block_ids)]
        if self.rt.prefix is not None:
            self.rt.prefix.pulled(len(src))
        if h.first_token is not None:
            marks.stamp("kv_sent", h.sent_ns)
            marks.stamp("kv_read", read)
            assert consumer is not None  # admit checked
            self._start_pull(seq, lambda done: consumer.pull(src, dst, h.event_slot, done))
            return
        assert consumer is not None  # admit checked; it refuses an early one without early_handoff
        try:  # all but the enqueue now, while the prefill computes (NIXL push: the PUSH too)
            seq.plan = consumer.early(consumer.plan(src, dst, h.event_slot), h.request_id)
        except Exception as exc:  # a bug or a bad mapping: fail this request, keep the link
            self._fail(seq, exc)
            return
        if self.rt.prefix is not None:  # the names its pull publishes, now rather than then
            self.rt.prefix.complete(seq.names)
        self.engine.expect()  # it joins within about one prefill forward: stay warm for it

    def kv_launched(self, peer: Peer, msg: KvLaunched) -> None:
        """KV_LAUNCHED: an AWAITING_KV sequence's forward and first token are queued on the
        prefill's GPU. When it may (`_may_launch`) its pull starts now, behind the event slot,
        and it joins the batch with its first token on the GPU (module docstring); else KV_READY
        starts it as usual. For a request not awaiting its KV, dropped (as KV_READY)."""
        read = time.monotonic_ns()
        seq = self._table.get(seq_key(peer.link_id, msg.request_id))
        if seq is None or seq.phase is not Phase.AWAITING_KV:
            phase = None if seq is None else seq.phase
            race = phase in (None, Phase.ENDING)  # refused, or ended meanwhile: dropped
            out_of_phase("KV_LAUNCHED", peer, msg.request_id, phase, INFO if race else WARNING)
            return
        seq.launched = True
        seq.marks.stamp("kv_launched_read", read)
        seq.marks.stamp("kv_launched_sent", msg.sent_ns)
        consumer, plan, first = peer.consumer, seq.plan, self._first_token
        if not self._may_launch(seq) or consumer is None or plan is None or first is None:
            return
        seq.marks.stamp("launch_started", read)
        seq.marks.stamp("kv_read", read)
        seq.marks.stamp("kv_sent", msg.sent_ns)
        seq.plan, seq.first_on_device, seq.first_pending = None, first, True
        launch = dataclasses.replace(plan, first_into=first)
        self.launched_first += 1
        self._last_launched = seq
        if self.prefill_first is not None:
            self.prefill_first.moved()
        self._start_pull(seq, lambda done: consumer.start(launch, done))

    def _may_launch(self, seq: Sequence) -> bool:
        """Whether `seq` may start on KV_LAUNCHED: plain, on a link with the prefill's mailbox
        and on our GPU (one stream order for the copy; another GPU's events are left to
        KV_READY), an event slot named, steps overlapped, and nothing else to decode (no step
        running, launched ahead or queued): its first step then waits for the prefill alone.
        And no earlier launched pull outstanding (one whose sequence ended before its step):
        it could still write `_first_token` after this one's."""
        consumer, last = seq.link.consumer, self._last_launched
        return (
            self._first_token is not None
            and seq.plain
            and seq.event_slot >= 0
            and consumer is not None
            and consumer.mailbox is not None
            and consumer.shares_device
            and not self._stepping
            and not len(self.engine)
            and not self.engine.ahead
            and (last is None or not last.pull_outstanding)
        )

    def kv_ready(self, peer: Peer, msg: KvReady) -> None:
        """KV_READY: an AWAITING_KV sequence's KV is written and `msg.first_token` is its first
        token: its pull starts (for one launched on KV_LAUNCHED: the host has its first token,
        `_first_arrived`). A first token past the vocabulary: BAD_REQUEST, ENDING. For a
        request not awaiting its KV, dropped (the protocol's answer to one it does not hold)."""
        read = time.monotonic_ns()
        seq = self._table.get(seq_key(peer.link_id, msg.request_id))
        if seq is not None and seq.first_pending and seq.phase is not Phase.ENDING:
            self._first_arrived(seq, msg, read)
            return
        if seq is None or seq.phase is not Phase.AWAITING_KV:
            phase = None if seq is None else seq.phase
            race = phase in (None, Phase.ENDING)  # refused, or ended meanwhile: dropped
            out_of_phase("KV_READY", peer, msg.request_id, phase, INFO if race else WARNING)
            return
        if msg.first_token >= self.vocab_size:
            peer.post_error(
                ErrorCode.BAD_REQUEST,
                f"first token {msg.first_token} is not below the vocab size {self.vocab_size}",
                msg.request_id,
            )
            self._end(seq)
            return
        seq.generated.append(msg.first_token)
        marks = seq.marks
        marks.stamp("kv_ready_read", read)
        marks.stamp("kv_ready_sent", msg.sent_ns)
        marks.stamp("kv_read", read)
        marks.stamp("kv_sent", msg.sent_ns)
        plan, seq.plan = seq.plan, None
        consumer = peer.consumer
        assert consumer is not None and plan is not None  # planned at HANDOFF
        if self.prefill_first is not None:
            self.prefill_first.moved()
        self._start_pull(seq, lambda done: consumer.start(plan, done))

    def _first_arrived(self, seq: Sequence, msg: KvReady, read: int) -> None:
        """KV_READY for a sequence launched on KV_LAUNCHED: the host has its first token (its
        first step's result may be read now), and its RELEASE goes if the pull is done."""
        seq.first_pending = False
        self._first_known.set()
        if msg.first_token >= self.vocab_size:
            why = f"first token {msg.first_token} is not below the vocab size {self.vocab_size}"
            seq.link.post_error(ErrorCode.BAD_REQUEST, why, seq.request_id)
            self._end(seq)
            return
        seq.generated.append(msg.first_token)
        seq.marks.stamp("kv_ready_read", read)
        seq.marks.stamp("kv_ready_sent", msg.sent_ns)
        if seq.release_due:
            self._release(seq)
        if seq.check_finished():  # never for a plain launched one (P would have sent ABORT)
            seq.link.post(finish(seq))
            self._end(seq)

    def pull_done(self, seq: Sequence, exc: BaseException | None) -> None:
        """Pull done (the consumer's `done`, once per started pull): RELEASE (the peer may reuse
        its blocks and event slot); PULLING joins the batch, or gets its FINISH when its first
        token finished it; DECODING goes on; ENDING frees its blocks once no step runs. A failed
        pull: ERROR INTERNAL (none once ENDING), ENDING."""
        if not seq.pull_outstanding or self._table.get(seq.key) is not seq:
            out_of_phase("pull done", seq.link, seq.request_id, seq.phase, ERROR)
            return
        seq.pull_outstanding = False
        if exc is not None:
            self._fail(seq, exc)
            return
        seq.marks.stamp("pulled")
        # its prompt blocks are written: reusable from now on; not an ended one's, whose peer
        # may have freed (and reused) its blocks before our copy read them
        if self.rt.prefix is not None and seq.phase is not Phase.ENDING:
            self.rt.prefix.publish(seq.key, seq.names)
        seq.link.handoffs += 1
        self.handoffs += 1
        if seq.first_pending and seq.phase is not Phase.ENDING:
            seq.release_due = True  # the prefill takes no RELEASE before its KV_READY
        else:
            self._release(seq)
        if seq.phase is Phase.PULLING:
            if seq.finish_reason:
                seq.link.post(finish(seq))
                self._end(seq)
            else:
                self._join(seq, None)
        elif seq.phase is Phase.ENDING:
            self._free_if_done(seq)

    def _release(self, seq: Sequence) -> None:
        """RELEASE: the pull is done, the peer may reuse its blocks and event slot."""
        seq.release_due = False
        seq.link.post(Release(request_id=seq.request_id, event_slot=seq.event_slot))
        if self._yield_after_release:
            # CPU: the RELEASE wakes the prefill onto the CPU this loop runs on, and this loop
            # would go on into the next step first (0.1-1.8 ms on a 2-vCPU VM); let it read it
            os.sched_yield()

    def step_done(self, results: list[tuple[Sequence, int]]) -> None:
        """A step's results: each sequence's token in its link's STEP_TOKENS, with the FINISH
        (ENDING) of those it finished; ERROR NUMERIC_ERROR (ENDING) for one that failed alone.
        Each link's frames in one write."""
        out = Outbox()
        self.throughput.add(len(results), requests=sum(1 for s, _ in results if s.finish_reason))
        for seq, tok in results:
            if seq.phase is not Phase.DECODING or self._table.get(seq.key) is not seq:
                out_of_phase("step result", seq.link, seq.request_id, seq.phase, ERROR)
                continue
            if seq.error is not None:  # this sequence alone failed; the batch goes on
                rid, link = seq.request_id, seq.link.link_id
                log.warning("sequence_failed", request_id=rid, link=link, error=seq.error)
                out.add(seq.link, make_error(ErrorCode.NUMERIC_ERROR, seq.error, seq.request_id))
                self._end(seq)
                continue
            out.token(seq.link, seq.request_id, tok, seq.last_logprob)
            if seq.steps == 1:
                seq.marks.stamp("first_posted")
            if seq.finish_reason:
                out.finish(seq.link, finish(seq))
                self._end(seq)
        out.send()

    def abort(self, peer: Peer, request_id: str) -> None:
        """ABORT from the prefill (its client went away): ENDING, answered with nothing (a pull
        outstanding is answered by its RELEASE); CACHE_NOT_EXIST for a request not held."""
        seq = self._table.get(seq_key(peer.link_id, request_id))
        if seq is None or seq.phase is Phase.ENDING:
            phase = None if seq is None else seq.phase
            why = "ABORT names no request of this link"
            out_of_phase("ABORT", peer, request_id, phase, INFO, (CACHE_NOT_EXIST, why))
            return
        if seq.launched and seq.phase is Phase.AWAITING_KV:  # P waits for our answer to it
            self._release(seq)  # nothing started on its slot: answered at once
        self._end(seq, may_land=False)  # an early one: P ended it before writing its KV
        log.info("request_aborted", request_id=request_id, link=peer.link_id)

    def drop_peer(self, peer: Peer) -> int:
        """Link lost (its pulls drained): its live sequences go ENDING; how many."""
        live = [s for s in self._table.values() if s.link is peer and s.phase is not Phase.ENDING]
        for seq in live:
            self._end(seq)
        return len(live)

    def shutdown(self, code: ErrorCode, message: str) -> int:
        """The daemon ends: every live sequence gets ERROR `code` and goes ENDING; how many."""
        live = self.sequences()
        for seq in live:
            seq.link.post_error(code, message, seq.request_id)
            self._end(seq)
        return len(live)

    # ---- transitions -------------------------------------------------------------------------------
    def _start_pull(self, seq: Sequence, start: StartPull) -> None:
        """`seq`'s KV is written: start its pull (PULLING). It joins the batch at once when a
        step can read its blocks in stream order (CUDA: the step's stream waits on what `start`
        returned), else on pull done: a copy done inside `start` (CPU) or a NIXL transfer.
        One its first token finished stays PULLING: FINISH goes after the pull."""
        seq.check_finished()
        seq.phase, seq.pull_outstanding = Phase.PULLING, True
        seq.marks.stamp("pull_started")
        try:
            ready = start(functools.partial(self.pull_done, seq))
        except Exception as exc:  # a bug or a bad mapping: fail this request, keep the link
            seq.pull_outstanding = False  # `done` never runs
            self._fail(seq, exc)
            return
        enqueued = seq.marks.stamp("enqueued")
        if seq.phase is Phase.DECODING:  # joined inside `start`: the copy is done (CPU)
            seq.marks.stamp("usable", enqueued)
        elif seq.phase is Phase.PULLING and ready is not AFTER_DONE and not seq.finish_reason:
            self._join(seq, ready)

    def _join(self, seq: Sequence, ready: Any) -> None:
        """Into the batch (DECODING) at the next step; `ready`: what its first step waits on."""
        seq.ready = ready
        seq.phase = Phase.DECODING
        joined = seq.marks.stamp("joined")
        seq.marks.stamp("usable", joined)
        self.engine.add(seq)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """Its pull failed or could not start (a bug, a bad mapping): this request alone fails
        (ERROR INTERNAL; after KV_LAUNCHED also once it had ended: the prefill keeps its slot
        from reuse until it hears of it), the link goes on."""
        log.error("pull_failed", request_id=seq.request_id, link=seq.link.link_id, exc_info=exc)
        if seq.phase is Phase.ENDING:
            if seq.launched:  # an ABORT the pull's RELEASE would have answered
                seq.link.post_error(ErrorCode.INTERNAL, f"pull failed: {exc}", seq.request_id)
            self._free_if_done(seq)
            return
        seq.link.post_error(ErrorCode.INTERNAL, f"pull failed: {exc}", seq.request_id)
        self._end(seq)

    def _end(self, seq: Sequence, *, may_land: bool = True) -> None:
        """ENDING: out of the batch, answered by the caller; its blocks are freed now, or once
        its pull and the step in flight are over. A planned pull is discarded: what its plan
        asked the peer for (a NIXL push) may still write the blocks unless `may_land` is False
        (the peer ended the request before its KV was written), and then holds them."""
        if seq.phase is Phase.DECODING:
            self.engine.remove(seq.key)
        plan, consumer = seq.plan, seq.link.consumer
        if seq.phase is Phase.AWAITING_KV and self.prefill_first is not None:
            self.prefill_first.moved()
        seq.phase, seq.plan = Phase.ENDING, None
        if seq.first_pending:  # launched on KV_LAUNCHED: the loop waits for it no more
            seq.first_pending = False
            self._first_known.set()
        if seq.release_due:  # its pull is done: the peer's slot and blocks are free to go
            self._release(seq)
        if plan is not None and consumer is not None:
            landed = functools.partial(self._discarded, seq)
            seq.pull_outstanding = consumer.discard(plan, landed, may_land=may_land)
        self._free_if_done(seq)

    def _discarded(self, seq: Sequence, exc: BaseException | None) -> None:
        """A discarded plan's transfer is over (landed, failed or given up): no RELEASE is due,
        the blocks are free to go."""
        seq.pull_outstanding = False
        self._free_if_done(seq)

    def _free_if_done(self, seq: Sequence) -> None:
        """An ENDING sequence leaves the table and frees its blocks, unless its pull may still
        write them (pull_done calls again) or a step may: the one running, or one launched
        ahead and not read yet (`run` sweeps after each step)."""
        if seq.pull_outstanding:
            return
        if self._stepping or self.engine.in_flight(seq.key):
            self._ended_in_step = True
            return
        if self._table.pop(seq.key, None) is seq:
            self.rt.allocator.free(seq.key)

    def _free_ended(self) -> None:
        """After a step: free the sequences that went ENDING while it ran (no pull outstanding)."""
        if not self._ended_in_step:
            return
        self._ended_in_step = False
        for seq in [s for s in self._table.values() if s.phase is Phase.ENDING]:
            self._free_if_done(seq)
