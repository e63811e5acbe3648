"""A table of phases moved by named events: what each daemon keeps of a request's life
(prefill_server/phase.py, decode_server/phase.py), each with its own phases, events and moves.

A daemon moves a request's phase only through its table: `next_phase` gives where an event
takes it, or raises IllegalEvent (a peer's mistake, or a bug) naming the request, the event
and the phase; `accepts` asks first, for an event a peer may send out of turn.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Generic, TypeVar

from common.errors import PdkvError

P = TypeVar("P", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class IllegalEvent(PdkvError):
    """An event that cannot happen in the request's phase (a peer's mistake, or a bug here)."""

    def __init__(self, request_id: str, phase: enum.Enum, event: enum.Enum) -> None:
        super().__init__(f"request {request_id}: {event.name} cannot happen in phase {phase.name}")
        self.request_id = request_id
        self.phase = phase
        self.event = event


class PhaseTable(Generic[P, E]):
    """event -> {phase it may happen in -> the phase it moves to}."""

    def __init__(self, moves: Mapping[E, Mapping[P, P]]) -> None:
        self._moves = moves

    def accepts(self, phase: P, event: E) -> bool:
        """True if `event` may happen in `phase`."""
        return phase in self._moves[event]

    def next_phase(self, request_id: str, phase: P, event: E) -> P:
        """The phase `event` moves a request in `phase` to; IllegalEvent if it cannot happen
        there."""
        to = self._moves[event].get(phase)
        if to is None:
            raise IllegalEvent(request_id, phase, event)
        return to


__all__ = ["IllegalEvent", "PhaseTable"]
