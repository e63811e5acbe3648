"""The decode daemon's requests across all links: the events that move the sequences of the
table (decode_server/table.py; the phases, events and the one table of moves are
decode_server/phase.py's).

An event that is illegal in a sequence's phase is logged (`event_out_of_phase`, with the request
id and the phase) and answered only where docs/protocol.md says so. A sequence holds its blocks
from HANDOFF until it leaves the table: an ended one keeps them while a transfer (ENDING_PULL,
ABORTED_PULL) or a step in flight may still touch them (a new pull into them would not be
ordered after either).

`run()` is the decode loop: the engine steps, and each step's results are the STEP event.
The launched first step (KV_LAUNCHED) lives in decode_server/launched.py, entered from
`kv_launched`, `run` and KV_READY.
"""

from __future__ import annotations

import time
from logging import ERROR, INFO, WARNING

import structlog

from common.daemon.runtime import ModelRuntime
from common.daemon.throughput import Throughput
from common.errors import OutOfBlocks
from common.kv.tier_io import settle, writeback
from common.protocol import ErrorCode, Handoff, KvLaunched, KvReady, make_error
from decode_server.admission import admit
from decode_server.answers import Outbox, finish, out_of_phase
from decode_server.engine import DecodeEngine
from decode_server.launched import FIRST_TOKEN_WAIT_S, LaunchedFirst
from decode_server.peer import Peer
from decode_server.phase import (
    AWAITING,
    ENDED,
    FIRST_DUE,
    Event,
    Phase,
    accepts,
)
from decode_server.prefill_first import PrefillFirst
from decode_server.sequence import Sequence, seq_key
from decode_server.table import SequenceTable

log = structlog.get_logger(__name__)
BAD_REQUEST, CACHE_NOT_EXIST = ErrorCode.BAD_REQUEST, ErrorCode.CACHE_NOT_EXIST


class DecodeRequests(SequenceTable):
    """The events from the links (HANDOFF, KV_LAUNCHED, KV_READY, ABORT, a link lost) and the
    decode loop's (`run`: each step's results), moving the sequences of the table."""

    def __init__(
        self,
        rt: ModelRuntime,
        *,
        max_batch: int,
        overlap: str = "off",
        warm_wait: bool = False,
        prefill_first_ms: float = 0.0,
    ) -> None:
        self.overlap = overlap  # --overlap-steps as resolved: "on", "always" or "off"
        hold = self._prefilling if overlap == "on" else None
        expecting = self._prefilling if warm_wait else None  # --warm-wait (warm.py)
        engine = DecodeEngine(
            rt, max_batch=max_batch, overlap=overlap != "off", hold=hold, expecting=expecting
        )
        # --prefill-first-ms (prefill_first.py): hold a step while a prefill computes our prompts
        prefill_first = PrefillFirst(prefill_first_ms) if prefill_first_ms > 0 else None
        super().__init__(rt, engine, LaunchedFirst(rt, overlap), prefill_first)
        self.vocab_size = rt.model.config.vocab_size
        self._stop_ids = rt.model.config.stop_token_ids  # a property that builds a set: once
        self.throughput = Throughput()  # tokens decoded, sequences finished: for status

    @property
    def launched_first(self) -> int:
        """Sequences whose pull and first step started on KV_LAUNCHED."""
        return self.launch.count

    def __len__(self) -> int:
        return len(self.engine)  # in the batch or queued for it

    def _prefilling(self) -> bool:
        """Whether a prefill computes a prompt it handed to us early (a sequence awaits its
        KV): --overlap-steps on launches no step ahead meanwhile, leaving the GPU's gaps
        between steps to that forward."""
        return any(s.phase in AWAITING for s in self._table.values())

    def _awaiting_kv(self) -> list[str]:
        """The keys of the sequences handed to us early whose KV a prefill on our own device
        still computes (a prefill on another GPU or host does not take turns with our steps)."""
        return [
            k
            for k, s in self._table.items()
            if s.phase in AWAITING and s.link.consumer is not None and s.link.consumer.shares_device
        ]

    def awaits_kv(self, peer: Peer) -> bool:
        """Whether the loop has nothing to step and a sequence of `peer`'s awaits its KV: while
        so, the link may be polled for that KV_READY (server.py) without taking the CPU from a
        step."""
        if self._stepping or len(self.engine) or self.engine.ahead:
            return False
        return any(s.link is peer and s.phase in AWAITING for s in self._table.values())

    async def run(self) -> None:
        """The decode loop: step while there is work, answer each step's sequences. Ends only
        when cancelled; a failing step raises (nothing here can decode any more)."""
        try:
            while True:
                await self.engine.wait_for_work()
                launching = self.engine.launching
                if self.prefill_first is not None and not self.engine.ahead and not launching:
                    await self.prefill_first.hold(self._awaiting_kv)
                await self.launch.wait_firsts(self.engine, self._first_never_came)
                self._stepping = True
                try:
                    results = await self.engine.step()
                finally:
                    self._stepping = False
                    self._free_ended()
                writeback(self.rt, results)  # the blocks it filled, before any is freed
                self.step_done(results)  # no sleep(0) after: every step suspends in rt.run,
                # and link traffic (a HANDOFF joining the next step) is handled meanwhile
        finally:
            self._stepping = False
            self.engine.settle()  # a step launched ahead may still write its sequences' K/V
            self._free_ended()

    def _first_never_came(self, seq: Sequence) -> None:
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
        settle(self.rt)  # the host tier's write-backs are done reading freed blocks
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
        self._move(seq, Event.EARLY)
        if self.rt.prefix is not None:  # the names its pull publishes, now rather than then
            self.rt.prefix.complete(seq.names)
        self.engine.expect()  # it joins within about one prefill forward: stay warm for it

    def _arrived(self, frame: str, peer: Peer, request_id: str, event: Event) -> Sequence | None:
        """The sequence a KV_LAUNCHED or KV_READY names, if `event` may happen in its phase;
        else None, the frame dropped and logged (INFO for a request refused or ended meanwhile,
        the protocol's answer to one it does not hold)."""
        seq = self._table.get(seq_key(peer.link_id, request_id))
        if seq is not None and accepts(seq.phase, event):
            return seq
        phase = None if seq is None else seq.phase
        race = phase is None or phase in ENDED
        out_of_phase(frame, peer, request_id, phase, INFO if race else WARNING)
        return None

    def kv_launched(self, peer: Peer, msg: KvLaunched) -> None:
        """KV_LAUNCHED: an AWAITING_KV sequence's forward and first token are queued on the
        prefill's GPU. When it may (launched.py) its pull starts now, behind the event slot,
        and it joins the batch with its first token on the GPU (FIRST_PENDING); else KV_READY
        starts it as usual (AWAITING_READY). For a request not awaiting its KV, dropped."""
        read = time.monotonic_ns()
        seq = self._arrived("KV_LAUNCHED", peer, msg.request_id, Event.LAUNCH_SEEN)
        if seq is None:
            return
        seq.marks.stamp("kv_launched_read", read)
        seq.marks.stamp("kv_launched_sent", msg.sent_ns)
        consumer = peer.consumer
        may = seq.phase is Phase.AWAITING_KV and consumer is not None
        if not may or not self.launch.may_launch(seq, self.engine, self._stepping):
            self._move(seq, Event.LAUNCH_SEEN)
            return
        assert consumer is not None
        seq.marks.stamp("launch_started", read)
        seq.marks.stamp("kv_read", read)
        seq.marks.stamp("kv_sent", msg.sent_ns)
        launch = self.launch.launch_plan(seq)
        seq.plan = None
        if self.prefill_first is not None:
            self.prefill_first.moved()
        self._start_pull(seq, lambda done: consumer.start(launch, done), Event.PULL_LAUNCHED)

    def kv_ready(self, peer: Peer, msg: KvReady) -> None:
        """KV_READY: an awaiting sequence's KV is written and `msg.first_token` is its first
        token: its pull starts (for one started on KV_LAUNCHED: the host has its first token,
        `_first_arrived`). A first token past the vocabulary: BAD_REQUEST, ended. For a
        request not awaiting its KV, dropped (the protocol's answer to one it does not hold)."""
        read = time.monotonic_ns()
        held = self._table.get(seq_key(peer.link_id, msg.request_id))
        if held is not None and held.phase in FIRST_DUE:
            self._first_arrived(held, msg, read)
            return
        seq = self._arrived("KV_READY", peer, msg.request_id, Event.PULL)
        if seq is None or seq.phase is Phase.NEW:
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
        """KV_READY for a sequence started on KV_LAUNCHED: the host has its first token (its
        first step's result may be read now), and its RELEASE goes if the pull is done."""
        self.launch.arrived()
        if msg.first_token >= self.vocab_size:
            why = f"first token {msg.first_token} is not below the vocab size {self.vocab_size}"
            seq.link.post_error(ErrorCode.BAD_REQUEST, why, seq.request_id)
            self._end(seq)
            return
        seq.generated.append(msg.first_token)
        seq.marks.stamp("kv_ready_read", read)
        seq.marks.stamp("kv_ready_sent", msg.sent_ns)
        release_due = seq.phase is Phase.FIRST_PULLED
        self._move(seq, Event.FIRST_READY)
        if release_due:
            self._release(seq)
        if seq.check_finished():  # never for a plain launched one (P would have sent ABORT)
            seq.link.post(finish(seq))
            self._end(seq)

    def step_done(self, results: list[tuple[Sequence, int]]) -> None:
        """A step's results (STEP): each sequence's token in its link's STEP_TOKENS, with the
        FINISH of those it finished (END); ERROR NUMERIC_ERROR (END) for one that failed alone.
        Each link's frames in one write."""
        out = Outbox()
        self.throughput.add(len(results), requests=sum(1 for s, _ in results if s.finish_reason))
        for seq, tok in results:
            if self._table.get(seq.key) is not seq or not accepts(seq.phase, Event.STEP):
                out_of_phase("step result", seq.link, seq.request_id, seq.phase, ERROR)
                continue
            if seq.error is not None:  # this sequence alone failed; the batch goes on
                rid, link = seq.request_id, seq.link.link_id
                log.warning("sequence_failed", request_id=rid, link=link, error=seq.error)
                out.add(seq.link, make_error(ErrorCode.NUMERIC_ERROR, seq.error, seq.request_id))
                self._end(seq)
                continue
            self._move(seq, Event.STEP)
            out.token(seq.link, seq.request_id, tok, seq.last_logprob)
            if seq.steps == 1:
                seq.marks.stamp("first_posted")
            if seq.finish_reason:
                out.finish(seq.link, finish(seq))
                self._end(seq)
        out.send()

    def abort(self, peer: Peer, request_id: str) -> None:
        """ABORT from the prefill (its client went away): ended, answered with nothing but
        what it is owed: after KV_LAUNCHED with nothing started, RELEASE at once; a pull
        outstanding, by its RELEASE (or ERROR if it fails). CACHE_NOT_EXIST for a request not
        held."""
        seq = self._table.get(seq_key(peer.link_id, request_id))
        if seq is None or not accepts(seq.phase, Event.ABORT):
            phase = None if seq is None else seq.phase
            why = "ABORT names no request of this link"
            out_of_phase("ABORT", peer, request_id, phase, INFO, (CACHE_NOT_EXIST, why))
            return
        if seq.phase is Phase.AWAITING_READY:  # P waits for our answer to its KV_LAUNCHED
            self._release(seq)  # nothing started on its slot: answered at once
        self._end(seq, Event.ABORT)  # an early one: P ended it before writing its KV
        log.info("request_aborted", request_id=request_id, link=peer.link_id)

    def drop_peer(self, peer: Peer) -> int:
        """Link lost (its pulls drained): its live sequences end; how many."""
        live = [s for s in self._table.values() if s.link is peer and s.phase not in ENDED]
        for seq in live:
            self._end(seq)
        return len(live)

    def shutdown(self, code: ErrorCode, message: str) -> int:
        """The daemon ends: every live sequence gets ERROR `code` and ends; how many."""
        live = self.sequences()
        for seq in live:
            seq.link.post_error(code, message, seq.request_id)
            self._end(seq)
        return len(live)

    # ---- transitions -------------------------------------------------------------------------------
