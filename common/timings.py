"""A request's timings as named marks, kept apart from the code that decides what happens to it.

Control flow only stamps marks (`marks.stamp("pulled")`); what FINISH reports is declared once per
daemon as spans between two marks (`Span("pull_us", "pull_read", "pulled")`) and rendered in one
place (`Marks.render`). A span whose marks are not both set is left out, so a path that skips a
stage (a late handoff has no `kv_ready_sent`) needs no branch of its own; a span declared
`always` reads 0.0 then instead (a key FINISH's readers rely on).

Marks are CLOCK_MONOTONIC nanoseconds. A mark may come from the peer's clock (a frame's
`sent_ns`): that is only comparable on one host, so a link across hosts never stamps it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    """`key` (the FINISH timings key, its unit in the name) = mark `end` - mark `start`."""

    key: str
    start: str
    end: str
    unit_ns: int = 1000  # µs; 1_000_000 for a key in ms
    always: bool = False  # reported as 0.0 when a mark is unset, instead of left out

    def of(self, marks: Marks) -> float | None:
        start, end = marks.get(self.start), marks.get(self.end)
        if start is None or end is None:
            return 0.0 if self.always else None
        return round((end - start) / self.unit_ns, 3 if self.unit_ns >= 1_000_000 else 1)


class Marks:
    """Named monotonic-ns instants of one request. Stamping a name again moves it."""

    __slots__ = ("_ns",)

    def __init__(self) -> None:
        self._ns: dict[str, int] = {}

    def stamp(self, name: str, ns: int | None = None) -> int:
        """Set mark `name` to `ns` (now when None) and return it; a 0 `ns` (a frame that carried
        no clock) sets nothing and returns 0."""
        if ns is None:
            ns = time.monotonic_ns()
        elif not ns:
            return 0
        self._ns[name] = ns
        return ns

    def get(self, name: str) -> int | None:
        return self._ns.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._ns

    def since(self, name: str, now: int | None = None) -> float:
        """Microseconds from mark `name` to `now` (default: now); 0.0 if the mark is unset."""
        start = self._ns.get(name)
        if start is None:
            return 0.0
        return ((time.monotonic_ns() if now is None else now) - start) / 1000

    def render(self, spans: Iterable[Span]) -> dict[str, float]:
        """The FINISH timings of these spans, in their order: those with both marks set, and
        the `always` ones."""
        out: dict[str, float] = {}
        for span in spans:
            value = span.of(self)
            if value is not None:
                out[span.key] = value
        return out


__all__ = ["Marks", "Span"]
