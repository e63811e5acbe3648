"""A progress counter for the CLI ("3/8 requests finished"): redrawn in place on a terminal, whole
lines elsewhere, so a log file or a pipe never gets carriage returns that run the updates together.
"""

from __future__ import annotations

from typing import TextIO

#: Off a terminal, a line at every tenth of the total (and at the end), not one per update.
_STEPS_OFF_TERMINAL = 10


class Progress:
    """Counts `total` items as they finish and shows `done/total label` on `stream`.

    On a terminal the line is redrawn with a carriage return and ended by `close()`; on anything
    else each shown count is a whole line of its own, at most `_STEPS_OFF_TERMINAL` + 1 of them.
    """

    def __init__(self, stream: TextIO, total: int, label: str, indent: str = "  ") -> None:
        self.stream = stream
        self.total = total
        self.label = label
        self.indent = indent
        self.done = 0
        self.tty = _isatty(stream)
        self._every = max(1, total // _STEPS_OFF_TERMINAL)
        self._drawn = False

    def advance(self, n: int = 1) -> None:
        """`n` more items finished."""
        self.done += n
        text = f"{self.indent}{self.done}/{self.total} {self.label}"
        if self.tty:
            self.stream.write("\r" + text)
            self._drawn = True
        elif self.done % self._every == 0 or self.done >= self.total:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the redrawn line on a terminal (nothing to end elsewhere); idempotent."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
