"""Holding decode steps while the prefill computes (`--prefill-first-ms`).

On one GPU without MPS the two daemons' kernels never run at once: the GPU time-slices between
their contexts. While the prefill computes a burst of prompts, every decode step the decode
launches meanwhile takes a slice from those forwards, and at a small batch (the first few
sequences of the burst) a step costs nearly what a full one does. One process instead computes
the burst's prompts first and then decodes them all together.

With a hold of N ms, before a step the decode looks at the sequences that a prefill handed to it
early and whose KV is not written yet (AWAITING_KV: a forward is computing them now). While any
of those still awaits its KV, and for at most N ms, the decode launches no step. Then it steps at
least once before it holds again, so decoding sequences advance one step per prefill forward at
the least, and a token waits at most N ms more than it would. Sequences that arrive during a
hold are not waited for in it.

Only sequences from a link whose consumer `shares_device` count: a prefill on another GPU or
host does not take turns with our steps. 50 ms on CUDA by default, off on the CPU: it trades the
decoding sequences' inter-token latency in a burst for the waiting prompts' TTFT and the burst's
throughput (docs/operations.md, "Both daemons on one GPU: prefill first").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable


class PrefillFirst:
    """The hold before a decode step (module docstring); `moved` wakes it."""

    def __init__(self, max_ms: float) -> None:
        if max_ms <= 0:
            raise ValueError(f"a hold of {max_ms} ms: give a positive bound, or no PrefillFirst")
        self.max_s = max_ms / 1e3
        self._moved = asyncio.Event()
        self.holds = 0  # holds that waited at all
        self.timeouts = 0  # of those, the ones that ended at the bound
        self.held_s = 0.0  # their total time

    def moved(self) -> None:
        """A sequence left AWAITING_KV (its KV_READY came, or it ended)."""
        self._moved.set()

    async def hold(self, awaiting: Callable[[], Iterable[str]]) -> None:
        """Wait while any sequence that `awaiting()` names now still appears in it, at most
        `max_s`; at once when none does."""
        keys = set(awaiting())
        if not keys:
            return
        t0 = time.monotonic()
        deadline = t0 + self.max_s
        self.holds += 1
        try:
            while True:
                self._moved.clear()
                keys.intersection_update(awaiting())
                if not keys:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    self.timeouts += 1
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await self._moved.wait()
        finally:
            self.held_s += time.monotonic() - t0


__all__ = ["PrefillFirst"]
