"""The prefill request's phase table: the paths a request takes, and every event its phase cannot
take refused with an error naming the request, the event and the phase."""

from __future__ import annotations

import itertools

import pytest

from common.model.sampling import SamplingParams
from prefill_server.phase import Event, IllegalEvent, Phase, accepts
from prefill_server.request import PrefillRequest

E, P = Event, Phase


def _request() -> PrefillRequest:
    return PrefillRequest("r-7", [1, 2, 3], SamplingParams(max_tokens=4))


PATHS = {
    "early, released, finished": (
        [E.QUEUE, E.OFFER_EARLY, E.READY, E.RELEASE, E.TOKENS, E.FINISH, E.END],
        [P.QUEUED, P.OFFERED, P.LEASED, P.RELEASED, P.RELEASED, P.DONE, P.ENDED],
    ),
    "late, tokens before the release (CUDA)": (
        [E.QUEUE, E.OFFER, E.TOKENS, E.RELEASE, E.FINISH, E.END],
        [P.QUEUED, P.LEASED, P.LEASED, P.RELEASED, P.DONE, P.ENDED],
    ),
    "finish before the release (CUDA)": (
        [E.QUEUE, E.OFFER, E.FINISH, E.RELEASE, E.END],
        [P.QUEUED, P.LEASED, P.ANSWERED, P.DONE, P.ENDED],
    ),
    "early refused, offered again with the first token": (
        [E.QUEUE, E.OFFER_EARLY, E.NO_CAPACITY, E.OFFER, E.RELEASE],
        [P.QUEUED, P.OFFERED, P.REFUSED, P.LEASED, P.RELEASED],
    ),
    "late refused, offered again": (
        [E.QUEUE, E.OFFER, E.NO_CAPACITY, E.OFFER],
        [P.QUEUED, P.LEASED, P.REFUSED, P.LEASED],
    ),
    "ended while the decode may wait on the slot": (
        [E.QUEUE, E.OFFER_EARLY, E.READY, E.ABORT, E.ABORT_ANSWERED],
        [P.QUEUED, P.OFFERED, P.LEASED, P.ABORTING, P.ENDED],
    ),
    "link lost while aborting": (
        [E.QUEUE, E.OFFER, E.ABORT, E.LINK_LOST],
        [P.QUEUED, P.LEASED, P.ABORTING, P.ENDED],
    ),
    "link lost during the forward, offered again": (
        [E.QUEUE, E.OFFER_EARLY, E.LINK_LOST, E.OFFER, E.RELEASE],
        [P.QUEUED, P.OFFERED, P.REFUSED, P.LEASED, P.RELEASED],
    ),
    "link lost during the forward, no other": (
        [E.QUEUE, E.OFFER_EARLY, E.LINK_LOST, E.END],
        [P.QUEUED, P.OFFERED, P.REFUSED, P.ENDED],
    ),
    "the HANDOFF's write failed": ([E.QUEUE, E.OFFER, E.UNSENT], [P.QUEUED, P.LEASED, P.DONE]),
    "launched, ready, released, finished": (
        [E.QUEUE, E.OFFER_EARLY, E.LAUNCH, E.READY, E.RELEASE, E.TOKENS, E.FINISH, E.END],
        [P.QUEUED, P.OFFERED, P.LAUNCHED, P.LEASED, P.RELEASED, P.RELEASED, P.DONE, P.ENDED],
    ),
    "launched, aborted before its KV_READY, answered": (
        [E.QUEUE, E.OFFER_EARLY, E.LAUNCH, E.ABORT, E.ABORT_ANSWERED],
        [P.QUEUED, P.OFFERED, P.LAUNCHED, P.ABORTING, P.ENDED],
    ),
    "launched, refused (NO_CAPACITY crossed it), offered again": (
        [E.QUEUE, E.OFFER_EARLY, E.LAUNCH, E.NO_CAPACITY, E.OFFER, E.RELEASE],
        [P.QUEUED, P.OFFERED, P.LAUNCHED, P.REFUSED, P.LEASED, P.RELEASED],
    ),
    "launched, link lost: the blocks still ours, offered to another decode": (
        [E.QUEUE, E.OFFER_EARLY, E.LAUNCH, E.LINK_LOST, E.OFFER, E.RELEASE],
        [P.QUEUED, P.OFFERED, P.LAUNCHED, P.REFUSED, P.LEASED, P.RELEASED],
    ),
    "launched, the decode's ERROR, then its RELEASE": (
        [E.QUEUE, E.OFFER_EARLY, E.LAUNCH, E.ERROR, E.RELEASE],
        [P.QUEUED, P.OFFERED, P.LAUNCHED, P.ANSWERED, P.DONE],
    ),
    "launched, the KV_LAUNCHED's write failed": (
        [E.QUEUE, E.OFFER_EARLY, E.LAUNCH, E.UNSENT],
        [P.QUEUED, P.OFFERED, P.LAUNCHED, P.DONE],
    ),
    "ended before its forward": ([E.END], [P.ENDED]),
}


@pytest.mark.parametrize("name", PATHS)
def test_a_request_takes_each_path_phase_by_phase(name: str) -> None:
    events, phases = PATHS[name]
    req = _request()
    assert req.phase is P.ADMITTED
    assert [req.advance(e) for e in events] == phases


ILLEGAL = [
    (P.OFFERED, E.RELEASE),  # a RELEASE for a request only offered: its KV is being written
    (P.QUEUED, E.RELEASE),
    (P.RELEASED, E.RELEASE),  # a second RELEASE
    (P.OFFERED, E.TOKENS),  # tokens before the decode could read the KV
    (P.OFFERED, E.FINISH),
    (P.REFUSED, E.FINISH),
    (P.QUEUED, E.ERROR),  # the decode knows nothing of it
    (P.RELEASED, E.NO_CAPACITY),  # refused after it was accepted
    (P.LEASED, E.READY),  # a second KV_READY
    (P.OFFERED, E.OFFER),  # a second HANDOFF while the first stands
    (P.LEASED, E.OFFER_EARLY),
    (P.ADMITTED, E.OFFER),  # offered before its forward was queued
    (P.QUEUED, E.QUEUE),
    (P.OFFERED, E.ABORT),  # quarantine for a slot the decode never waits on
    (P.ABORTING, E.END),  # ended twice
    (P.ENDED, E.END),
    (P.ENDED, E.TOKENS),
    (P.LAUNCHED, E.RELEASE),  # a RELEASE before the decode read KV_READY
    (P.LAUNCHED, E.TOKENS),  # tokens before the decode has the first token on its host
    (P.LAUNCHED, E.FINISH),
    (P.LAUNCHED, E.LAUNCH),  # a second KV_LAUNCHED
    (P.QUEUED, E.LAUNCH),  # launched without an early HANDOFF
    (P.LEASED, E.LAUNCH),  # launched after its KV_READY (or a HANDOFF with its first token)
]


@pytest.mark.parametrize(("phase", "event"), ILLEGAL)
def test_an_event_its_phase_cannot_take_is_refused_naming_the_request(
    phase: Phase, event: Event
) -> None:
    req = _request()
    req.phase = phase
    with pytest.raises(IllegalEvent) as info:
        req.advance(event)
    assert req.phase is phase
    assert info.value.request_id == "r-7" and (info.value.phase, info.value.event) == (phase, event)
    assert (
        "r-7" in str(info.value) and event.name in str(info.value) and phase.name in str(info.value)
    )


def test_accepts_agrees_with_advance_for_every_phase_and_event() -> None:
    for phase, event in itertools.product(Phase, Event):
        req = _request()
        req.phase = phase
        try:
            req.advance(event)
            moved = True
        except IllegalEvent:
            moved = False
        assert moved is accepts(phase, event), (phase, event)


def test_every_phase_but_aborting_and_ended_can_end_and_ended_takes_nothing() -> None:
    assert {p for p in Phase if accepts(p, E.END)} == set(Phase) - {P.ABORTING, P.ENDED}
    assert not any(accepts(P.ENDED, e) for e in Event)


def test_launched_takes_exactly_the_events_of_an_offer_whose_kv_ready_is_due() -> None:
    # LAUNCHED: the decode may wait on the slot, KV_READY (which leases the blocks) still to go
    # out; only an early offer is launched
    assert {e for e in Event if accepts(P.LAUNCHED, e)} == {
        E.READY,
        E.NO_CAPACITY,
        E.ERROR,
        E.LINK_LOST,
        E.UNSENT,
        E.ABORT,
        E.END,
    }
    assert {p for p in Phase if accepts(p, E.LAUNCH)} == {P.OFFERED}
