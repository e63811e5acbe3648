"""Requests in the decode daemon, across all links: HANDOFF → pull → RELEASE → batch → TOKENS/FINISH.

Per HANDOFF: validate, reserve this request's blocks for its whole life (or answer NO_CAPACITY),
pull the prompt's blocks from the peer's pool into ours, send RELEASE once the copy is complete,
and add the sequence to the continuous-batching loop. Sequences are keyed `link/request_id`:
request ids are only unique per prefill daemon.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from common.errors import OutOfBlocks, PdkvError
from common.modelrt import ModelRuntime
from common.protocol import (
    ErrorCode,
    Finish,
    Handoff,
    Message,
    Release,
    Tokens,
    Usage,
    make_error,
)
from common.throughput import Throughput
from decode_server.engine import DecodeEngine
from decode_server.peer import Peer
from decode_server.sequence import Sequence, blocks_needed, seq_key

log = structlog.get_logger(__name__)


class DecodeRequests:
    def __init__(
        self, rt: ModelRuntime, *, max_batch: int, on_fatal: Callable[[BaseException], None]
    ) -> None:
        self.rt = rt
        self.engine = DecodeEngine(
            rt, max_batch=max_batch, on_step=self._on_step, on_fatal=on_fatal
        )
        self.vocab_size = rt.model.config.vocab_size
        self.seq_peer: dict[str, Peer] = {}  # key -> the link the sequence came from
        self._pulling: dict[str, bool] = {}  # key -> aborted while its pull was in flight
        self.handoffs = 0
        self.throughput = Throughput()  # tokens decoded, sequences finished: for status

    def __len__(self) -> int:
        return len(self.engine)

    def abort(self, peer: Peer, request_id: str) -> None:
        """ABORT from the prefill (its client went away): free the sequence, or CACHE_NOT_EXIST."""
        key = seq_key(peer.link_id, request_id)
        if key in self._pulling:
            self._pulling[key] = True  # freed once the in-flight pull completes
            return
        seq = self.engine.remove(key)
        if seq is None:
            peer.post_error(
                ErrorCode.CACHE_NOT_EXIST, "ABORT names no request of this link", request_id
            )
            return
        self._free(seq)
        seq.finish_reason = "abort"
        log.info("request_aborted", request_id=seq.request_id, link=peer.link_id)

    def drop_peer(self, peer: Peer) -> int:
        """Link lost: drop its sequences and free their blocks; returns how many."""
        dropped = 0
        for seq in self.engine.sequences():
            if seq.peer == peer.link_id:
                self.engine.remove(seq.key)
                self._free(seq)
                dropped += 1
        return dropped

    def handoff(self, peer: Peer, h: Handoff) -> None:
        """Validate, reserve blocks for the request's whole life, pull, RELEASE, join the batch."""
        recv_ns = time.monotonic_ns()
        key = seq_key(peer.link_id, h.request_id)
        consumer = peer.consumer
        try:
            if consumer is None:
                raise ValueError("HANDOFF before REGISTER")
            consumer.validate(h, self.vocab_size)
            if key in self.seq_peer:
                raise ValueError("request id already in flight on this link")
        except (ValueError, PdkvError) as exc:
            log.warning(
                "handoff_rejected", request_id=h.request_id, link=peer.link_id, error=str(exc)
            )
            peer.post_error(ErrorCode.BAD_REQUEST, str(exc), h.request_id)
            return
        need = blocks_needed(h.num_tokens, h.sampling.max_tokens, self.rt.layout.block_size)
        if need > self.rt.allocator.total:
            peer.post_error(
                ErrorCode.BAD_REQUEST,
                f"prompt + max_tokens need {need} KV blocks, the decode pool has "
                f"{self.rt.allocator.total} (lower max_tokens or raise the decode's --num-blocks)",
                h.request_id,
            )
            return
        try:
            blocks = self.rt.allocator.allocate(key, need)
        except OutOfBlocks as exc:
            log.info(
                "handoff_no_capacity",
                request_id=h.request_id,
                link=peer.link_id,
                need=need,
                free=exc.free,
            )
            peer.post_error(ErrorCode.NO_CAPACITY, str(exc), h.request_id)
            return
        self.seq_peer[key] = peer
        self._pulling[key] = False

        def done(exc: BaseException | None) -> None:
            if exc is None:
                self._pulled(peer, h, key, blocks, recv_ns)
            else:
                self._pull_failed(peer, h, key, exc)

        consumer.pull(h.block_ids, blocks[: len(h.block_ids)], h.event_slot, done)

    def _pull_failed(self, peer: Peer, h: Handoff, key: str, exc: BaseException) -> None:
        """The copy failed (a bug or a bad mapping): fail this request, keep the link."""
        log.error("pull_failed", request_id=h.request_id, link=peer.link_id, exc_info=exc)
        self._pulling.pop(key, None)
        self.seq_peer.pop(key, None)
        if key in self.rt.allocator:
            self.rt.allocator.free(key)
        peer.post_error(ErrorCode.INTERNAL, f"pull failed: {exc}", h.request_id)

    def _pulled(self, peer: Peer, h: Handoff, key: str, blocks: list[int], recv_ns: int) -> None:
        """The copy is complete: RELEASE, then join the batch (unless aborted meanwhile)."""
        done_ns = time.monotonic_ns()
        aborted = self._pulling.pop(key, True)
        peer.post(Release(request_id=h.request_id, event_slot=h.event_slot))
        peer.handoffs += 1
        self.handoffs += 1
        if aborted or peer.closed:
            self.seq_peer.pop(key, None)
            if key in self.rt.allocator:
                self.rt.allocator.free(key)
            return
        seq = Sequence(
            request_id=h.request_id,
            peer=peer.link_id,
            prompt_len=h.num_tokens,
            generated=[h.first_token],
            blocks=blocks,
            sampling=h.sampling,
            stop_ids=self.rt.model.config.stop_token_ids,
            block_size=self.rt.layout.block_size,
            handoff_us=(done_ns - h.sent_ns) / 1000 if h.sent_ns else 0.0,
            pull_us=(done_ns - recv_ns) / 1000,
        )
        if seq.check_finished():
            peer.post(self._finished(peer, seq))  # nothing left to decode
            return
        self.engine.add(seq)
        log.debug(
            "handoff_accepted",
            request_id=h.request_id,
            link=peer.link_id,
            blocks=len(h.block_ids),
            pull_us=round(seq.pull_us, 1),
        )

    def _on_step(self, results: list[tuple[Sequence, int]]) -> None:
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
                self._free(seq)
                msgs.append(make_error(ErrorCode.NUMERIC_ERROR, seq.error, seq.request_id))
                continue
            msgs.append(Tokens(request_id=seq.request_id, tokens=[tok]))
            if seq.finish_reason:
                msgs.append(self._finished(peer, seq))
        for peer, msgs in out.values():
            peer.post_many(msgs)

    def _finished(self, peer: Peer, seq: Sequence) -> Finish:
        """Free a finished sequence's blocks; its FINISH (the prefill logs the request's line)."""
        self._free(seq)
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
                "decode_ms": round(decode_ms, 3),
            },
        )

    def _free(self, seq: Sequence) -> None:
        key = seq.key
        self.seq_peer.pop(key, None)
        if key in self.rt.allocator:
            self.rt.allocator.free(key)

    def drop(self, seq: Sequence, code: ErrorCode, message: str) -> None:
        """End a sequence with an ERROR to its link (e.g. SHUTTING_DOWN)."""
        peer = self.seq_peer.get(seq.key)
        self.engine.remove(seq.key)
        self._free(seq)
        if peer is not None:
            peer.post_error(code, message, seq.request_id)
