"""A decode request's life as one phase, moved only by events, through the one table below.

```
NEW ─EARLY─▶ AWAITING_KV ─LAUNCH_SEEN─▶ AWAITING_READY            (early HANDOFF, KV_LAUNCHED)
NEW, AWAITING_KV, AWAITING_READY ─PULL─▶ PULLING                 (its first token on the host)
AWAITING_KV ─PULL_LAUNCHED─▶ FIRST_PENDING                       (KV_LAUNCHED: first token on the GPU)

PULLING ─JOIN─▶ DECODING_PULL ─PULL_DONE─▶ DECODING ◀─JOIN─ PULLED ◀─PULL_DONE─ PULLING
FIRST_PENDING ─PULL_DONE─▶ FIRST_PULLED ─FIRST_READY─▶ DECODING
FIRST_PENDING ─FIRST_READY─▶ DECODING_PULL
DECODING, DECODING_PULL ─STEP─▶ itself

it ends (FINISH or ERROR answered, link lost, shutdown: END; ABORT; a failed pull: FAIL):
  a transfer outstanding ─▶ ENDING_PULL (or ABORTED_PULL) ─PULL_DONE, LANDED or FAIL─▶ ENDING
  nothing outstanding    ─▶ ENDING ─FREE─▶ ENDED (blocks freed once no step holds it)
```

What each phase means for the peer's pool, our blocks and the batch (the sequence's cleanup
follows from it alone):

- NEW: admitted, blocks reserved, nothing planned or started (a HANDOFF being taken).
- AWAITING_KV: an early HANDOFF: its pull planned (`Sequence.plan`), nothing read of the peer's
  pool; KV_READY (its first token) starts the pull, or KV_LAUNCHED when the loop is idle.
- AWAITING_READY: KV_LAUNCHED came but nothing started on it: KV_READY starts the pull as for
  AWAITING_KV, and an ABORT is answered with RELEASE at once (the prefill keeps the event slot
  from reuse until it hears from us).
- PULLING: its pull in flight, the sequence outside the batch (a NIXL transfer, a CPU copy
  while it runs, or a sequence its first token finished): RELEASE on its completion.
- PULLED: the pull done and RELEASE sent, out of the batch: it joins the batch or gets its
  FINISH at once.
- DECODING_PULL: in the batch while its pull is in flight (CUDA: its first step's stream waits
  for the pull on the GPU): RELEASE once the host sees the pull done.
- FIRST_PENDING: started on KV_LAUNCHED: in the batch, its pull in flight, its first token on
  the GPU only (copied from the prefill's mailbox by the pull); no step result of it is read
  before KV_READY gives the host that token.
- FIRST_PULLED: as FIRST_PENDING with the pull done: its RELEASE waits for that KV_READY too
  (the prefill takes none before).
- DECODING: in the batch, nothing outstanding: each step sends its token, the last one FINISH.
- ENDING_PULL: ended while a transfer may still write its blocks (a started pull, or a
  discarded plan's NIXL push): they stay ours until it is over.
- ABORTED_PULL: as ENDING_PULL, ended by ABORT after its pull started: the prefill waits for
  our answer, RELEASE when the pull is done or ERROR when it failed.
- ENDING: answered or aborted, nothing outstanding: its blocks are freed once no step in flight
  holds it.
- ENDED: out of the table, its blocks freed.
"""

from __future__ import annotations

import enum

from common.phases import IllegalEvent, PhaseTable


class Phase(enum.Enum):
    NEW = "new"
    AWAITING_KV = "awaiting_kv"
    AWAITING_READY = "awaiting_ready"
    PULLING = "pulling"
    PULLED = "pulled"
    DECODING_PULL = "decoding_pull"
    FIRST_PENDING = "first_pending"
    FIRST_PULLED = "first_pulled"
    DECODING = "decoding"
    ENDING_PULL = "ending_pull"
    ABORTED_PULL = "aborted_pull"
    ENDING = "ending"
    ENDED = "ended"


class Event(enum.Enum):
    EARLY = "early"  # an early HANDOFF (no first token): its pull planned
    LAUNCH_SEEN = "launch_seen"  # KV_LAUNCHED, nothing started on it
    PULL = "pull"  # its pull started, its first token on the host (HANDOFF or KV_READY)
    PULL_LAUNCHED = "pull_launched"  # its pull and first step started on KV_LAUNCHED
    JOIN = "join"  # into the batch
    PULL_DONE = "pull_done"  # the started pull completed: RELEASE due (now or at KV_READY)
    FIRST_READY = "first_ready"  # KV_READY for one started on KV_LAUNCHED
    STEP = "step"  # a step's token for it
    END = "end"  # answered (FINISH, ERROR), its link lost or the daemon stopping
    END_LANDING = "end_landing"  # ended before its pull started, a discarded push may land
    ABORT = "abort"  # the prefill's ABORT
    LANDED = "landed"  # a discarded plan's transfer is over
    FAIL = "fail"  # its pull failed or could not start (ERROR INTERNAL where one is owed)
    FREE = "free"  # its blocks freed: out of the table


P = Phase
#: in the batch (or queued to join it): the engine holds it
IN_BATCH = frozenset((P.DECODING, P.DECODING_PULL, P.FIRST_PENDING, P.FIRST_PULLED))
#: a started transfer's completion is still due: it may write the sequence's blocks
TRANSFER_DUE = frozenset(
    (P.PULLING, P.DECODING_PULL, P.FIRST_PENDING, P.ENDING_PULL, P.ABORTED_PULL)
)
#: started on KV_LAUNCHED, the host still lacks its first token (KV_READY brings it)
FIRST_DUE = frozenset((P.FIRST_PENDING, P.FIRST_PULLED))
#: answered or aborted: nothing more is sent for it but a RELEASE or ERROR still owed
ENDED = frozenset((P.ENDING_PULL, P.ABORTED_PULL, P.ENDING, P.ENDED))
#: before its pull starts: the HANDOFF's plan is all it has of the peer
AWAITING = frozenset((P.AWAITING_KV, P.AWAITING_READY))

_MOVES: dict[Event, dict[Phase, Phase]] = {
    Event.EARLY: {P.NEW: P.AWAITING_KV},
    Event.LAUNCH_SEEN: {P.AWAITING_KV: P.AWAITING_READY, P.AWAITING_READY: P.AWAITING_READY},
    Event.PULL: dict.fromkeys((P.NEW, P.AWAITING_KV, P.AWAITING_READY), P.PULLING),
    Event.PULL_LAUNCHED: {P.AWAITING_KV: P.FIRST_PENDING},
    Event.JOIN: {P.PULLING: P.DECODING_PULL, P.PULLED: P.DECODING},
    Event.PULL_DONE: {
        P.PULLING: P.PULLED,
        P.DECODING_PULL: P.DECODING,
        P.FIRST_PENDING: P.FIRST_PULLED,
        P.ENDING_PULL: P.ENDING,
        P.ABORTED_PULL: P.ENDING,
    },
    Event.FIRST_READY: {P.FIRST_PENDING: P.DECODING_PULL, P.FIRST_PULLED: P.DECODING},
    Event.STEP: {P.DECODING: P.DECODING, P.DECODING_PULL: P.DECODING_PULL},
    Event.END: {
        **dict.fromkeys((P.NEW, P.AWAITING_KV, P.AWAITING_READY, P.PULLED), P.ENDING),
        **dict.fromkeys((P.DECODING, P.FIRST_PULLED), P.ENDING),  # FIRST_PULLED: RELEASE now
        **dict.fromkeys((P.PULLING, P.DECODING_PULL, P.FIRST_PENDING), P.ENDING_PULL),
    },
    Event.END_LANDING: dict.fromkeys((P.AWAITING_KV, P.AWAITING_READY), P.ENDING_PULL),
    Event.ABORT: {
        **dict.fromkeys((P.AWAITING_KV, P.AWAITING_READY, P.PULLED), P.ENDING),
        **dict.fromkeys((P.DECODING, P.FIRST_PULLED), P.ENDING),
        **dict.fromkeys((P.PULLING, P.DECODING_PULL, P.FIRST_PENDING), P.ABORTED_PULL),
    },
    Event.LANDED: {P.ENDING_PULL: P.ENDING},
    Event.FAIL: dict.fromkeys(
        (P.NEW, P.PULLING, P.DECODING_PULL, P.FIRST_PENDING, P.ENDING_PULL, P.ABORTED_PULL),
        P.ENDING,
    ),
    Event.FREE: {P.ENDING: P.ENDED},
}


_TABLE = PhaseTable(_MOVES)
accepts = _TABLE.accepts
next_phase = _TABLE.next_phase


__all__ = [
    "AWAITING",
    "ENDED",
    "FIRST_DUE",
    "IN_BATCH",
    "TRANSFER_DUE",
    "Event",
    "IllegalEvent",
    "Phase",
    "accepts",
    "next_phase",
]
