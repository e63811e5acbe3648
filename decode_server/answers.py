"""What the decode says about its requests: FINISH, a step's frames grouped per link, and the
log line (and ERROR, where the protocol names one) for an event a request's phase does not allow.

The request table (requests.py) decides what goes out and when; this module only builds it.
"""

from __future__ import annotations

import logging

import structlog

from common.protocol import ErrorCode, Finish, Message, Usage
from decode_server.peer import Peer
from decode_server.sequence import Phase, Sequence
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


class Outbox:
    """One step's frames, per link in their order; `send` writes each link's in one write."""

    __slots__ = ("_links",)

    def __init__(self) -> None:
        self._links: dict[str, tuple[Peer, list[Message]]] = {}

    def add(self, peer: Peer, msg: Message) -> None:
        self._links.setdefault(peer.link_id, (peer, []))[1].append(msg)

    def send(self) -> None:
        for peer, msgs in self._links.values():
            peer.post_many(msgs)


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
