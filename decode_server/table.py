"""The decode's table of sequences and its transitions: every sequence across all links, keyed
by (link, request id), each in one phase (decode_server/phase.py), moved only by `_move`.

Here is what a sequence's move does beside its phase: start a pull and join the batch, RELEASE
when a pull is done (after KV_LAUNCHED not before KV_READY), end (answered by the caller, a
planned pull discarded), and free the blocks of an ended one once no transfer and no step in
flight may touch them. The frames that cause the moves are DecodeRequests' (requests.py).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from logging import ERROR
from typing import Any

import structlog

from common.daemon.runtime import ModelRuntime
from common.protocol import ErrorCode, Release
from common.transfer.interface import AFTER_DONE, PullDone
from decode_server.answers import finish, out_of_phase
from decode_server.engine import DecodeEngine
from decode_server.launched import LaunchedFirst
from decode_server.phase import (
    AWAITING,
    ENDED,
    FIRST_DUE,
    IN_BATCH,
    Event,
    Phase,
    accepts,
    next_phase,
)
from decode_server.prefill_first import PrefillFirst
from decode_server.sequence import Sequence, seq_key

log = structlog.get_logger(__name__)
StartPull = Callable[[PullDone], Any]  # starts a pull with its `done`: what a reader waits on


class SequenceTable:
    def __init__(
        self,
        rt: ModelRuntime,
        engine: DecodeEngine,
        launch: LaunchedFirst,
        prefill_first: PrefillFirst | None,
    ) -> None:
        self.rt = rt
        self.engine = engine
        self.launch = launch  # KV_LAUNCHED's first steps (launched.py)
        self.prefill_first = prefill_first  # --prefill-first-ms (prefill_first.py)
        self._table: dict[str, Sequence] = {}  # seq_key(link, request id) -> its sequence
        self._stepping = False  # a decode step is in flight (DecodeRequests.run)
        self._ended_in_step = False  # a sequence ended during it: free after it
        self.handoffs = 0
        self._yield_after_release = rt.device.type == "cpu"

    def sequences(self) -> list[Sequence]:
        """Every live sequence (not ended): awaiting its KV, pulling it, or decoding."""
        return [s for s in self._table.values() if s.phase not in ENDED]

    def phase(self, link_id: str, request_id: str) -> Phase | None:
        """Where the request is; None once the decode holds nothing of it."""
        seq = self._table.get(seq_key(link_id, request_id))
        return None if seq is None else seq.phase

    def pull_done(self, seq: Sequence, exc: BaseException | None) -> None:
        """Pull done (the consumer's `done`, once per started pull): RELEASE (the peer may reuse
        its blocks and event slot; after KV_LAUNCHED not before KV_READY); PULLING joins the
        batch, or gets its FINISH when its first token finished it; one ended frees its blocks
        once no step runs. A failed pull: FAIL (ERROR INTERNAL where one is owed)."""
        if self._table.get(seq.key) is not seq or not accepts(seq.phase, Event.PULL_DONE):
            out_of_phase("pull done", seq.link, seq.request_id, seq.phase, ERROR)
            return
        if exc is not None:
            self._fail(seq, exc)
            return
        seq.marks.stamp("pulled")
        ended = seq.phase in ENDED
        # its prompt blocks are written: reusable from now on; not an ended one's, whose peer
        # may have freed (and reused) its blocks before our copy read them
        if self.rt.prefix is not None and not ended:
            self.rt.prefix.publish(seq.key, seq.names)
        seq.link.handoffs += 1
        self.handoffs += 1
        self._move(seq, Event.PULL_DONE)
        if seq.phase is not Phase.FIRST_PULLED:  # that one's RELEASE waits for its KV_READY
            self._release(seq)
        if seq.phase is Phase.PULLED:
            if seq.finish_reason:
                seq.link.post(finish(seq))
                self._end(seq)
            else:
                self._join(seq, None)
        elif ended:
            self._free_if_done(seq)

    def _release(self, seq: Sequence) -> None:
        """RELEASE: the pull is done, the peer may reuse its blocks and event slot."""
        seq.link.post(Release(request_id=seq.request_id, event_slot=seq.event_slot))
        if self._yield_after_release:
            # CPU: the RELEASE wakes the prefill onto the CPU this loop runs on, and this loop
            # would go on into the next step first (0.1-1.8 ms on a 2-vCPU VM); let it read it
            os.sched_yield()

    def _move(self, seq: Sequence, event: Event) -> None:
        """The one writer of a sequence's phase: through the table (phase.py); an event that
        cannot happen in its phase is a bug here, raised as IllegalEvent."""
        seq.phase = next_phase(seq.request_id, seq.phase, event)

    def _start_pull(self, seq: Sequence, start: StartPull, event: Event = Event.PULL) -> None:
        """`seq`'s KV is written: start its pull (PULLING, or FIRST_PENDING on KV_LAUNCHED).
        It joins the batch at once when a step can read its blocks in stream order (CUDA: the
        step's stream waits on what `start` returned), else on pull done: a copy done inside
        `start` (CPU) or a NIXL transfer. One its first token finished stays PULLING: FINISH
        goes after the pull."""
        seq.check_finished()
        self._move(seq, event)
        seq.marks.stamp("pull_started")
        try:
            ready = start(functools.partial(self.pull_done, seq))
        except Exception as exc:  # a bug or a bad mapping: fail this request, keep the link
            self._fail(seq, exc)  # `done` never runs
            return
        enqueued = seq.marks.stamp("enqueued")
        if seq.phase in FIRST_DUE:  # started on KV_LAUNCHED: in the batch at once
            self._join(seq, ready)
        elif seq.phase is Phase.DECODING:  # joined inside `start`: the copy is done (CPU)
            seq.marks.stamp("usable", enqueued)
        elif seq.phase is Phase.PULLING and ready is not AFTER_DONE and not seq.finish_reason:
            self._join(seq, ready)

    def _join(self, seq: Sequence, ready: Any) -> None:
        """Into the batch at the next step (JOIN, unless it started in it: FIRST_PENDING);
        `ready`: what its first step waits on."""
        if seq.phase not in FIRST_DUE:
            self._move(seq, Event.JOIN)
        seq.ready = ready
        joined = seq.marks.stamp("joined")
        seq.marks.stamp("usable", joined)
        self.engine.add(seq)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """Its pull failed or could not start (a bug, a bad mapping): this request alone fails
        (ERROR INTERNAL, unless it had ended with nothing owed: after an ABORT the prefill
        waits for RELEASE or ERROR), the link goes on."""
        log.error("pull_failed", request_id=seq.request_id, link=seq.link.link_id, exc_info=exc)
        if seq.phase is not Phase.ENDING_PULL:
            seq.link.post_error(ErrorCode.INTERNAL, f"pull failed: {exc}", seq.request_id)
        self._leave_batch(seq)
        self._move(seq, Event.FAIL)
        self._free_if_done(seq)

    def _leave_batch(self, seq: Sequence) -> None:
        """Out of the batch (the engine forgets it) and, if KV_READY was still due, of the
        launched first steps' wait."""
        if seq.phase in IN_BATCH:
            self.engine.remove(seq.key)
        if seq.phase in FIRST_DUE:  # the loop waits for its KV_READY no more
            self.launch.arrived()
        if seq.phase in AWAITING and self.prefill_first is not None:
            self.prefill_first.moved()

    def _end(self, seq: Sequence, event: Event = Event.END) -> None:
        """It ends (END or ABORT), answered by the caller: out of the batch; its blocks are
        freed now, or once its pull and the step in flight are over. A planned pull is
        discarded: what its plan asked the peer for (a NIXL push) may still write the blocks
        (END_LANDING) unless the peer ended the request before its KV was written (ABORT)."""
        self._leave_batch(seq)
        plan, consumer = seq.plan, seq.link.consumer
        seq.plan = None
        if seq.phase is Phase.FIRST_PULLED:  # its pull is done: the peer's slot and blocks go
            self._release(seq)
        if seq.phase in AWAITING and plan is not None and consumer is not None:
            landed = functools.partial(self._discarded, seq)
            if consumer.discard(plan, landed, may_land=event is not Event.ABORT):
                event = Event.END_LANDING
        self._move(seq, event)
        self._free_if_done(seq)

    def _discarded(self, seq: Sequence, exc: BaseException | None) -> None:
        """A discarded plan's transfer is over (landed, failed or given up): no RELEASE is due,
        the blocks are free to go."""
        if seq.phase is Phase.ENDING_PULL:
            self._move(seq, Event.LANDED)
            self._free_if_done(seq)

    def _free_if_done(self, seq: Sequence) -> None:
        """An ended sequence leaves the table and frees its blocks (FREE), unless a transfer may
        still write them (its completion calls again) or a step may: the one running, or one
        launched ahead and not read yet (`run` sweeps after each step)."""
        if seq.phase is not Phase.ENDING:
            return
        if self._stepping or self.engine.in_flight(seq.key):
            self._ended_in_step = True
            return
        if self._table.pop(seq.key, None) is seq:
            self._move(seq, Event.FREE)
            self.rt.allocator.free(seq.key)

    def _free_ended(self) -> None:
        """After a step: free the sequences that ended while it ran (nothing outstanding)."""
        if not self._ended_in_step:
            return
        self._ended_in_step = False
        for seq in [s for s in self._table.values() if s.phase is Phase.ENDING]:
            self._free_if_done(seq)
