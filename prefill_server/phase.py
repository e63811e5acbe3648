"""A prefill request's life as one phase, moved only by events, through the one table below.

```
ADMITTED ─QUEUE─▶ QUEUED ─OFFER_EARLY─▶ OFFERED ─READY─▶ LEASED ─RELEASE─▶ RELEASED ─FINISH─▶ DONE
                    │                                   ▲    │
                    └────────────────OFFER──────────────┘    └─FINISH─▶ ANSWERED ─RELEASE─▶ DONE

OFFERED ─LAUNCH─▶ LAUNCHED ─READY─▶ LEASED   (KV_LAUNCHED, then KV_READY)

OFFERED, LAUNCHED, LEASED ─NO_CAPACITY─▶ REFUSED ─OFFER─▶ LEASED
OFFERED, LAUNCHED, REFUSED ─LINK_LOST─▶ REFUSED
ERROR moves as FINISH does, and OFFERED ─ERROR─▶ DONE, LAUNCHED ─ERROR─▶ ANSWERED
OFFERED, LAUNCHED, LEASED, REFUSED ─UNSENT─▶ DONE
LEASED … ANSWERED ─LINK_LOST─▶ DONE
it ends:  LAUNCHED or LEASED ─ABORT─▶ ABORTING
              ─ABORT_ANSWERED, LINK_LOST or LEASE_EXPIRED─▶ ENDED
          any other phase ─END─▶ ENDED
```

What each phase means for the decode, our blocks and the event slot (the request's cleanup
follows from it alone):

- ADMITTED: waiting for the link, its blocks and an event slot. The decode knows nothing.
- QUEUED: its forward queued at the batcher (or run); nothing offered to the decode yet.
- OFFERED: an early HANDOFF went out: the decode may hold it (blocks reserved), but the KV is
  not written, so the decode never waits on its slot and never reads its blocks.
- LAUNCHED: after an early HANDOFF, KV_LAUNCHED went out: the forward, the first token's
  mailbox entry and the slot's record are queued on our GPU, not done. The decode may wait on
  the slot (and read the mailbox entry and the blocks once it completes), so the slot is
  quarantined if the request ends now; the blocks are still ours (KV_READY leases them, as
  after an early HANDOFF), and a link lost now sends the request to another decode. The decode sends no RELEASE, TOKENS or FINISH before it has
  read KV_READY (or, after an ABORT, anything but RELEASE or ERROR).
- LEASED: the KV is written and offered (HANDOFF with its first token, or KV_READY after an early
  one): the blocks are leased to the link, the decode may wait on the slot.
- RELEASED: RELEASE came: blocks and slot are free; the decode holds the sequence and decodes.
- REFUSED: the decode answered NO_CAPACITY, or the link of an early HANDOFF was lost before its
  KV_READY went (no token of it has left the daemons): it holds nothing; the HANDOFF goes again,
  with its first token, to another decode at once or after a backoff.
- ANSWERED: the decode's last answer (FINISH or ERROR) came while the KV was leased: it holds
  nothing, but its RELEASE may still follow (on CUDA it is sent when the copy's event completes,
  which can be after the step that used the copy).
- DONE: the decode holds nothing and owes nothing: its last answer came, the link was lost, or
  the HANDOFF did not go out whole.
- ABORTING: the request ended while the decode may wait on its event slot and read its blocks:
  ABORT went out, and the slot (quarantined) and the blocks (leased to the link) stay out of
  use until the decode answers (RELEASE or ERROR), the link ends or the lease expires. A forward
  writing those blocks for another prompt meanwhile would have the decode copy, and cache
  under this prompt's names, another prompt's KV.
- ENDED: nothing of it is left.
"""

from __future__ import annotations

import enum

from common.phases import IllegalEvent, PhaseTable


class Phase(enum.Enum):
    ADMITTED = "admitted"
    QUEUED = "queued"
    OFFERED = "offered"
    LAUNCHED = "launched"
    LEASED = "leased"
    RELEASED = "released"
    REFUSED = "refused"
    ANSWERED = "answered"
    DONE = "done"
    ABORTING = "aborting"
    ENDED = "ended"


class Event(enum.Enum):
    QUEUE = "queue"  # the prompt queued for its forward
    OFFER_EARLY = "offer_early"  # HANDOFF without its first token
    OFFER = "offer"  # HANDOFF with its first token: the blocks leased
    LAUNCH = "launch"  # KV_LAUNCHED: the blocks leased, KV_READY still due
    READY = "ready"  # KV_READY: the blocks leased
    UNSENT = "unsent"  # the HANDOFF's write failed: the decode cannot act on it
    RELEASE = "release"  # the decode's RELEASE
    TOKENS = "tokens"  # the decode's TOKENS
    FINISH = "finish"  # the decode's FINISH
    ERROR = "error"  # the decode's ERROR, other than NO_CAPACITY
    NO_CAPACITY = "no_capacity"  # the decode's ERROR NO_CAPACITY
    LINK_LOST = "link_lost"  # the link the request was offered on ended
    ABORT = "abort"  # ended: ABORT sent, its slot quarantined and its blocks kept
    ABORT_ANSWERED = "abort_answered"  # the decode's RELEASE or ERROR after that ABORT
    LEASE_EXPIRED = "lease_expired"  # no answer to that ABORT within the lease: given up on
    END = "end"  # ended: nothing left to wait for


P = Phase
_MOVES: dict[Event, dict[Phase, Phase]] = {
    Event.QUEUE: {P.ADMITTED: P.QUEUED},
    Event.OFFER_EARLY: {P.QUEUED: P.OFFERED},
    Event.OFFER: {P.QUEUED: P.LEASED, P.REFUSED: P.LEASED},
    Event.LAUNCH: {P.OFFERED: P.LAUNCHED},
    Event.READY: {P.OFFERED: P.LEASED, P.LAUNCHED: P.LEASED},
    # in DONE or REFUSED: the link was lost while the write was blocked (LINK_LOST moves an
    # early offer to REFUSED); the decode holds nothing either way
    Event.UNSENT: {
        **dict.fromkeys((P.OFFERED, P.LAUNCHED, P.LEASED, P.DONE, P.REFUSED), P.DONE),
    },
    Event.RELEASE: {P.LEASED: P.RELEASED, P.ANSWERED: P.DONE},
    Event.TOKENS: {P.LEASED: P.LEASED, P.RELEASED: P.RELEASED},
    Event.FINISH: {P.LEASED: P.ANSWERED, P.RELEASED: P.DONE},
    Event.ERROR: {
        P.OFFERED: P.DONE,
        P.LAUNCHED: P.ANSWERED,
        P.LEASED: P.ANSWERED,
        P.RELEASED: P.DONE,
    },
    Event.NO_CAPACITY: dict.fromkeys((P.OFFERED, P.LAUNCHED, P.LEASED), P.REFUSED),
    Event.LINK_LOST: {
        # the decode held nothing of it, or nothing readable: offered again, to another decode
        # (after KV_LAUNCHED its blocks are still ours: KV_READY leases them)
        P.OFFERED: P.REFUSED,
        P.LAUNCHED: P.REFUSED,
        P.REFUSED: P.REFUSED,
        **dict.fromkeys((P.LEASED, P.RELEASED, P.ANSWERED), P.DONE),
        P.ABORTING: P.ENDED,
    },
    Event.ABORT: {P.LAUNCHED: P.ABORTING, P.LEASED: P.ABORTING},
    Event.ABORT_ANSWERED: {P.ABORTING: P.ENDED},
    Event.LEASE_EXPIRED: {P.ABORTING: P.ENDED},
    Event.END: {p: P.ENDED for p in P if p not in (P.ABORTING, P.ENDED)},
}


_TABLE = PhaseTable(_MOVES)
accepts = _TABLE.accepts
next_phase = _TABLE.next_phase


__all__ = ["Event", "IllegalEvent", "Phase", "accepts", "next_phase"]
