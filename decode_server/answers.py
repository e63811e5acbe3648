"""What the decode says about its requests: FINISH, a step's answers per link (STEP_TOKENS),
and the log line (and ERROR, where the protocol names one) for an event a request's phase does
not allow.

The request table (requests.py) decides what goes out and when; this module only builds it.
"""

from __future__ import annotations

import logging

import structlog

from common.protocol import MAX_STEP_ENTRIES, ErrorCode, Finish, Message, StepTokens, Usage
from common.sampling_params import TokenLogprob
from decode_server.peer import Peer
from decode_server.phase import Phase
from decode_server.sequence import Sequence
from decode_server.timings import finish_timings

log = structlog.get_logger(__name__)


def finish(seq: Sequence) -> Finish:
    """`seq`'s FINISH: reason, usage and its timings (the prefill logs the request's line)."""
    seq.marks.stamp("finished")
    timings = finish_timings(seq)
    log.debug(
        "sequence_finished",
        request_id=seq.request_id,
        link=seq.link.link_id,
        reason=seq.finish_reason,
        completion_tokens=len(seq.generated),
        decode_ms=timings.get("decode_ms"),
    )
    return Finish(
        request_id=seq.request_id,
        reason=seq.finish_reason or "stop",
        usage=Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.generated)),
        timings=timings,
    )


class _LinkStep:
    """One link's share of a step: its sequences' tokens, their FINISHes, its other frames."""

    __slots__ = ("finishes", "ids", "logprobs", "others", "peer", "tokens")

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.ids: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob | None] | None = None  # a list once one entry has one
        self.finishes: list[tuple[int, Finish]] = []  # (the index of its request's token, it)
        self.others: list[Message] = []

    def frames(self) -> list[Message]:
        """Its other frames, then STEP_TOKENS of at most MAX_STEP_ENTRIES entries each, every
        FINISH in the frame of its request's token."""
        out = self.others
        n, step = len(self.ids), MAX_STEP_ENTRIES
        for lo in range(0, n, step):
            hi = lo + step
            lps = None if self.logprobs is None else self.logprobs[lo:hi]
            if lps is not None and lps.count(None) == len(lps):
                lps = None  # no entry of this frame asks
            ends = [f for i, f in self.finishes if lo <= i < hi]
            out.append(
                StepTokens(
                    request_ids=self.ids[lo:hi],
                    tokens=self.tokens[lo:hi],
                    logprobs=lps,
                    finishes=ends,
                )
            )
        return out


class Outbox:
    """One step's answers, per link: every sequence's token in STEP_TOKENS (one frame per link
    for up to MAX_STEP_ENTRIES sequences) with the FINISHes of the step, other frames (ERROR)
    before it; `send` writes each link's in one write."""

    __slots__ = ("_links",)

    def __init__(self) -> None:
        self._links: dict[str, _LinkStep] = {}

    def _of(self, peer: Peer) -> _LinkStep:
        step = self._links.get(peer.link_id)
        if step is None:
            step = self._links[peer.link_id] = _LinkStep(peer)
        return step

    def token(self, peer: Peer, request_id: str, token: int, logprob: TokenLogprob | None) -> None:
        """`request_id`'s new token (and its logprob when it asks for them)."""
        step = self._of(peer)
        if logprob is not None and step.logprobs is None:
            step.logprobs = [None] * len(step.ids)
        step.ids.append(request_id)
        step.tokens.append(token)
        if step.logprobs is not None:
            step.logprobs.append(logprob)

    def finish(self, peer: Peer, msg: Finish) -> None:
        """The FINISH of a request whose token this step carries (added before it)."""
        step = self._of(peer)
        step.finishes.append((len(step.ids) - 1, msg))

    def add(self, peer: Peer, msg: Message) -> None:
        """Another frame of the step (ERROR), sent before its tokens."""
        self._of(peer).others.append(msg)

    def send(self) -> None:
        for step in self._links.values():
            step.peer.post_many(step.frames())


def out_of_phase(
    on: str,
    peer: Peer,
    request_id: str,
    phase: Phase | None,
    level: int = logging.WARNING,
    answer: tuple[ErrorCode, str] | None = None,
) -> None:
    """Event `on` is not allowed in the request's `phase` (None: the decode holds nothing of
    it): logged with the request id at `level` (INFO: a race the protocol expects; ERROR: one
    of this daemon's own parts misbehaved), and answered with ERROR `answer` if given."""
    log.log(
        level,
        "event_out_of_phase",
        on=on,
        request_id=request_id,
        link=peer.link_id,
        phase=None if phase is None else phase.value,
    )
    if answer is not None:
        peer.post_error(*answer, request_id)


__all__ = ["Outbox", "finish", "out_of_phase"]
