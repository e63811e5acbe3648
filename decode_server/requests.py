"""Requests in the decode daemon, across all links: HANDOFF → pull → RELEASE → batch → TOKENS/FINISH.

Per HANDOFF: validate, reserve this request's blocks for its whole life (or answer NO_CAPACITY),
start the pull of the prompt's blocks from the peer's pool into ours, and add the sequence to the
batch at once: on CUDA the pull is stream-ordered and the step that first reads the blocks waits
for it on the GPU (engine.py), on CPU the copy is already complete; a NIXL pull (AFTER_DONE) joins
the batch in `_copied`. An early HANDOFF (no first token: the prefill sent it when it queued the
prompt's forward, so the blocks are not written yet) only reserves; the TOKENS frame that brings
its first token (`first_token`) says the KV is written, and starts the pull and the decoding. RELEASE goes out when the consumer reports the copy complete (`_copied`:
at once on CPU, from its waiter thread on CUDA, from the NIXL agent's worker on a TCP link).
Sequences are keyed `link/request_id`: request ids are only unique per prefill daemon.

Blocks: a sequence's blocks are freed exactly once, when it ends (FINISH, error, abort, link
loss, shutdown) — but not under work that may still touch them: if it ends while its pull is in
flight, when the pull completes; if it ends while a step runs, when that step returns. So a copy
never writes blocks another request owns, and a new pull never races a step's KV write.

`run()` is the decode loop: the engine steps, and each step's results go to the links from here.
"""

from __future__ import annotations

import functools
import os
import time

import structlog

from common.errors import OutOfBlocks, PdkvError
from common.modelrt import ModelRuntime
from common.protocol import (
    ErrorCode,
    Finish,
    Handoff,
    KvReady,
    Message,
    Release,
    Tokens,
    Usage,
    make_error,
)
from common.throughput import Throughput
from common.transfer.consumer import AFTER_DONE, KVConsumer, PullPlan
from decode_server.engine import DecodeEngine
from decode_server.peer import Peer
from decode_server.sequence import Sequence, blocks_needed, seq_key

log = structlog.get_logger(__name__)


class DecodeRequests:
    def __init__(self, rt: ModelRuntime, *, max_batch: int) -> None:
        self.rt = rt
        self.engine = DecodeEngine(rt, max_batch=max_batch)
        self.vocab_size = rt.model.config.vocab_size
        self._stop_ids = rt.model.config.stop_token_ids  # a property that builds a set: once
        self.seq_peer: dict[str, Peer] = {}  # key -> the link of every live sequence
        self._copying: set[str] = set()  # keys whose pull is not yet reported complete
        self._join_on_copy: dict[str, Sequence] = {}  # of those, the ones joining after it (NIXL)
        # early HANDOFFs awaiting their first token (their KV): key -> (HANDOFF, sequence, its
        # pull planned ahead)
        self._first_due: dict[str, tuple[Handoff, Sequence, PullPlan]] = {}
        self._stepping = False  # a decode step is in flight (run)
        self._deferred: list[str] = []  # keys whose blocks are freed when that step returns
        self.handoffs = 0
        self.throughput = Throughput()  # tokens decoded, sequences finished: for status
        self._yield_after_release = rt.device.type == "cpu"

    def __len__(self) -> int:
        return len(self.engine)  # in the batch or queued for it

    def sequences(self) -> list[Sequence]:
        """Every live sequence: in the batch or queued for it, awaiting its first token, or
        joining once its NIXL transfer is done."""
        due = [seq for _, seq, _ in self._first_due.values()]
        return [*self.engine.sequences(), *due, *self._join_on_copy.values()]

    async def run(self) -> None:
        """The decode loop: step while there is work, answer each step's sequences. Ends only
        when cancelled; a failing step raises (nothing here can decode any more)."""
        try:
            while True:
                await self.engine.wait_for_work()
                self._stepping = True
                try:
                    results = await self.engine.step()
                finally:
                    self._stepping = False
                    self._free_deferred()
                self._answer(results)  # no sleep(0) after: every step suspends in rt.run,
                # and link traffic (a HANDOFF joining the next step) is handled meanwhile
        finally:
            self._free_deferred()

    def abort(self, peer: Peer, request_id: str) -> None:
        """ABORT from the prefill (its client went away): free the sequence, or CACHE_NOT_EXIST."""
        key = seq_key(peer.link_id, request_id)
        if key not in self.seq_peer:
            peer.post_error(
                ErrorCode.CACHE_NOT_EXIST, "ABORT names no request of this link", request_id
            )
            return
        self.engine.remove(key)
        self._free(key)  # one awaiting its first token never pulled: no RELEASE is due
        log.info("request_aborted", request_id=request_id, link=peer.link_id)

    def kv_ready(self, peer: Peer, msg: KvReady) -> None:
        """KV_READY from the prefill: an early HANDOFF's KV is written and its first token is
        `msg.first_token`: start the pull, and the sequence joins the next step. One for a
        request that awaits none is dropped: the decode refused its HANDOFF (the prefill then
        hands off again, with the token) or the request ended meanwhile."""
        recv_ns = time.monotonic_ns()
        key = seq_key(peer.link_id, msg.request_id)
        entry = self._first_due.pop(key, None)
        if entry is None:
            log.debug("first_token_unexpected", request_id=msg.request_id, link=peer.link_id)
            return
        h, seq, plan = entry
        if msg.first_token >= self.vocab_size:
            peer.post_error(
                ErrorCode.BAD_REQUEST,
                f"first token {msg.first_token} is not below the vocab size {self.vocab_size}",
                msg.request_id,
            )
            self._free(key)
            return
        seq.generated.append(msg.first_token)
        seq.stages_us["first_wait_us"] = (recv_ns / 1e9 - seq.started) * 1e6  # since admitted
        if msg.sent_ns:
            seq.stages_us["first_read_us"] = (recv_ns - msg.sent_ns) / 1000
        self._start(peer, h, seq, recv_ns, msg.sent_ns, plan)

    def drop_peer(self, peer: Peer) -> int:
        """Link lost (its pulls drained): drop its sequences and free their blocks; how many."""
        keys = [k for k, p in self.seq_peer.items() if p is peer]
        for key in keys:
            self.engine.remove(key)
            self._free(key)
        return len(keys)

    def handoff(self, peer: Peer, h: Handoff) -> None:
        """Validate and reserve blocks for the request's whole life; then start the pull and
        join the batch, or, for an early HANDOFF, wait for the first token (its KV)."""
        recv_ns = time.monotonic_ns()
        seq = self._admit(peer, h)
        if seq is None:
            return
        admitted_ns = time.monotonic_ns()
        self.seq_peer[seq.key] = peer
        seq.stages_us = {"admit_us": (admitted_ns - recv_ns) / 1000}
        if h.sent_ns:
            seq.stages_us["read_us"] = (recv_ns - h.sent_ns) / 1000
            # of it, until this daemon's read callback had the bytes (the rest: split, decode)
            seq.stages_us["wire_us"] = (peer.channel.last_rx * 1e9 - h.sent_ns) / 1000
        if h.first_token is None:
            try:  # all but the enqueue now, while the prefill computes
                plan = self._plan(peer, h, seq)
            except Exception as exc:  # a bug or a bad mapping: fail this request, keep the link
                self._fail(peer, seq, exc)
                return
            self._first_due[seq.key] = (h, seq, plan)
        else:
            self._start(peer, h, seq, recv_ns, h.sent_ns)
        log.debug(
            "handoff_accepted", request_id=h.request_id, link=peer.link_id, blocks=len(h.block_ids)
        )

    @staticmethod
    def _plan(peer: Peer, h: Handoff, seq: Sequence) -> PullPlan:
        consumer = peer.consumer
        assert isinstance(consumer, KVConsumer)  # check_handoff refuses early ones over NIXL
        return consumer.plan(h.block_ids, seq.blocks[: len(h.block_ids)], h.event_slot)

    def _start(
        self,
        peer: Peer,
        h: Handoff,
        seq: Sequence,
        recv_ns: int,
        sent_ns: int,
        plan: PullPlan | None = None,
    ) -> None:
        """The KV of `seq` is written: start its pull (`plan`, if made ahead) and add it to the
        batch (a NIXL one joins in `_copied`; one with nothing to decode gets its FINISH after
        RELEASE there). `recv_ns`, `sent_ns`: when the frame that made the KV ready was read
        here and sent by the peer."""
        key, consumer = seq.key, peer.consumer
        assert consumer is not None  # _admit checked
        started_ns = time.monotonic_ns()
        seq.started = started_ns / 1e9  # first_step_us and decode_ms count from here
        self._copying.add(key)
        decode = seq.check_finished() is None  # else FINISH right after RELEASE (_copied)
        done = functools.partial(self._copied, peer, h, seq, recv_ns, sent_ns)
        try:
            if plan is not None:
                ready = consumer.start(plan, done)  # type: ignore[union-attr]
            else:
                ready = consumer.pull(
                    h.block_ids, seq.blocks[: len(h.block_ids)], h.event_slot, done
                )
        except Exception as exc:  # a bug or a bad mapping: fail this request, keep the link
            self._copying.discard(key)
            self._fail(peer, seq, exc)
            return
        if ready is AFTER_DONE:  # a NIXL transfer: no stream can wait on it, join on `done`
            if key in self._copying:
                self._join_on_copy[key] = seq
        elif decode:
            seq.ready = ready
            seq.joined_ns = time.monotonic_ns()
            self.engine.add(seq)
        now = time.monotonic_ns()
        seq.stages_us["enqueue_us"] = (now - started_ns) / 1000
        if sent_ns:
            seq.usable_us = (now - sent_ns) / 1000

    def _admit(self, peer: Peer, h: Handoff) -> Sequence | None:
        """Check a HANDOFF and reserve its blocks: its Sequence, or None once answered."""
        key = seq_key(peer.link_id, h.request_id)
        consumer = peer.consumer
        try:
            if consumer is None:
                raise ValueError("HANDOFF before REGISTER")
            consumer.validate(h, self.vocab_size)
            if key in self.rt.allocator:  # live, pulling, or its blocks not yet freed
                raise ValueError("request id already in flight on this link")
        except (ValueError, PdkvError) as exc:
            log.warning(
                "handoff_rejected", request_id=h.request_id, link=peer.link_id, error=str(exc)
            )
            peer.post_error(ErrorCode.BAD_REQUEST, str(exc), h.request_id)
            return None
        seq = Sequence(
            request_id=h.request_id,
            peer=peer.link_id,
            prompt_len=h.num_tokens,
            generated=[] if h.first_token is None else [h.first_token],
            blocks=[],
            sampling=h.sampling,
            stop_ids=self._stop_ids,
            block_size=self.rt.layout.block_size,
        )
        need = blocks_needed(h.num_tokens, h.sampling.max_tokens, self.rt.layout.block_size)
        if need > self.rt.allocator.total:
            peer.post_error(
                ErrorCode.BAD_REQUEST,
                f"prompt + max_tokens need {need} KV blocks, the decode pool has "
                f"{self.rt.allocator.total} (lower max_tokens or raise the decode's --num-blocks)",
                h.request_id,
            )
            return None
        try:
            seq.blocks = self.rt.allocator.allocate(key, need)
        except OutOfBlocks as exc:
            log.info(
                "handoff_no_capacity",
                request_id=h.request_id,
                link=peer.link_id,
                need=need,
                free=exc.free,
            )
            peer.post_error(ErrorCode.NO_CAPACITY, str(exc), h.request_id)
            return None
        return seq

    def _copied(
        self,
        peer: Peer,
        h: Handoff,
        seq: Sequence,
        recv_ns: int,
        sent_ns: int,
        exc: BaseException | None,
    ) -> None:
        """The consumer's `done`, exactly once per started pull: RELEASE (the peer may reuse its
        blocks and event slot), or fail the request; blocks of a sequence that ended meanwhile
        are freed now, and one with nothing to decode gets its FINISH."""
        key = seq.key
        self._copying.discard(key)
        join = self._join_on_copy.pop(key, None) is not None
        if exc is not None:
            self._fail(peer, seq, exc)
            return
        done_ns = time.monotonic_ns()
        seq.handoff_us = (done_ns - sent_ns) / 1000 if sent_ns else 0.0
        seq.pull_us = (done_ns - recv_ns) / 1000
        peer.post(Release(request_id=h.request_id, event_slot=h.event_slot))
        if self._yield_after_release:
            # CPU: the RELEASE wakes the prefill onto the CPU this loop runs on, and this loop
            # would go on into the next step first (0.1-1.8 ms on a 2-vCPU VM); let it read it
            os.sched_yield()
        peer.handoffs += 1
        self.handoffs += 1
        if key not in self.seq_peer:  # ended (abort, link loss) while its pull ran
            self._free_blocks(key)
        elif seq.finish_reason:  # finished at HANDOFF (a step's finish ends it in the same turn)
            peer.post(self._finished(peer, seq))
        elif join:  # the blocks are here now (NIXL): the sequence joins the next step
            seq.joined_ns = done_ns
            self.engine.add(seq)
            seq.usable_us = seq.handoff_us

    def _fail(self, peer: Peer, seq: Sequence, exc: BaseException) -> None:
        """The copy failed (a bug or a bad mapping): fail this request, keep the link."""
        log.error("pull_failed", request_id=seq.request_id, link=peer.link_id, exc_info=exc)
        live = seq.key in self.seq_peer
        self.engine.remove(seq.key)
        self._free(seq.key)
        if live:
            peer.post_error(ErrorCode.INTERNAL, f"pull failed: {exc}", seq.request_id)

    def _answer(self, results: list[tuple[Sequence, int]]) -> None:
        """After a step: each link gets its sequences' TOKENS (and FINISHes) in one write."""
        out: dict[str, tuple[Peer, list[Message]]] = {}
        finished = sum(1 for seq, _ in results if seq.finish_reason)
        self.throughput.add(len(results), requests=finished)
        for seq, tok in results:
            peer = self.seq_peer.get(seq.key)
            if peer is None:
                continue
            msgs = out.setdefault(peer.link_id, (peer, []))[1]
            if seq.error is not None:  # this sequence alone failed; the batch goes on
                log.warning(
                    "sequence_failed", request_id=seq.request_id, link=peer.link_id, error=seq.error
                )
                self._free(seq.key)
                msgs.append(make_error(ErrorCode.NUMERIC_ERROR, seq.error, seq.request_id))
                continue
            msgs.append(Tokens(request_id=seq.request_id, tokens=[tok]))
            if not seq.first_step_us:
                seq.first_step_us = (time.monotonic() - seq.started) * 1e6
            if seq.finish_reason:
                msgs.append(self._finished(peer, seq))
        for peer, msgs in out.values():
            peer.post_many(msgs)

    def _finished(self, peer: Peer, seq: Sequence) -> Finish:
        """Free a finished sequence's blocks; its FINISH (the prefill logs the request's line)."""
        self._free(seq.key)
        decode_ms = (time.monotonic() - seq.started) * 1000
        log.debug(
            "sequence_finished",
            request_id=seq.request_id,
            link=peer.link_id,
            reason=seq.finish_reason,
            completion_tokens=len(seq.generated),
            decode_ms=round(decode_ms, 2),
        )
        return Finish(
            request_id=seq.request_id,
            reason=seq.finish_reason or "stop",
            usage=Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.generated)),
            timings={
                "decode_handoff_us": round(seq.handoff_us, 1),
                "pull_us": round(seq.pull_us, 1),
                "usable_us": round(seq.usable_us, 1),
                "first_step_us": round(seq.first_step_us, 1),
                **{k: round(v, 1) for k, v in seq.stages_us.items()},
                **later_steps(seq),
                "decode_ms": round(decode_ms, 3),
            },
        )

    def _free(self, key: str) -> None:
        """A sequence ended: forget it and free its blocks, now or (pull in flight) in _copied."""
        self.seq_peer.pop(key, None)
        self._first_due.pop(key, None)
        if key not in self._copying:
            self._free_blocks(key)

    def _free_blocks(self, key: str) -> None:
        """Free a key's blocks — after the step in flight, if one is: it may still write the
        ended sequence's KV slot, and a pull into the same blocks is not ordered after it."""
        if self._stepping:
            self._deferred.append(key)
        elif key in self.rt.allocator:
            self.rt.allocator.free(key)

    def _free_deferred(self) -> None:
        keys, self._deferred = self._deferred, []
        for key in keys:
            self._free_blocks(key)

    def drop(self, seq: Sequence, code: ErrorCode, message: str) -> None:
        """End a sequence with an ERROR to its link (e.g. SHUTTING_DOWN)."""
        peer = self.seq_peer.get(seq.key)
        self.engine.remove(seq.key)
        self._free(seq.key)
        if peer is not None:
            peer.post_error(code, message, seq.request_id)


def later_steps(seq: Sequence) -> dict[str, float]:
    """`later_step_us`: the mean torch-thread time of a sequence's steps after its first (the
    first's, split in `stages_us`, is what the 2nd token waits for); absent with fewer than 2."""
    if seq.steps < 2:
        return {}
    return {"later_step_us": round(seq.later_step_ns / (seq.steps - 1) / 1000, 1)}
