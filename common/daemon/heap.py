"""The garbage collector in a serving daemon: the startup heap frozen, long collections logged.

A daemon starts with a large heap of objects that live as long as it does (torch, numpy, the
model's modules, the tokenizer): ~180k objects after the imports alone. CPython's full
collection walks every one of them each time it runs, and it runs every so often on its own while
requests allocate: 60 ms a pass on the 2-vCPU VM, a stall of every thread at once (the GIL),
which a request meets as a TTFT or inter-token gap far out in the tail. (On the H200 the decode's
loop stood still for ~30 ms during the first burst after a start, 2026-12-04; whether a
collection was the cause was not separated from the first pull's cost, docs/benchmarks.md.)

`freeze_startup_heap()`, once the daemon has loaded and warmed everything it keeps: one full
collection, then `gc.freeze()` moves every survivor to the permanent generation, which no
collection walks again (CPython's advice for exactly this; vLLM does the same after its graph
capture). Objects made later are collected as before.

`watch_pauses(min_ms)` logs each collection that took `min_ms` or more (`gc_pause`, with its
generation and objects collected), so a latency spike can be matched with one.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import structlog

log = structlog.get_logger(__name__)

#: collections at least this long are logged (gc_pause)
PAUSE_LOG_MS = 10.0


def freeze_startup_heap() -> int:
    """Collect once, then freeze what survived: the number of objects frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("heap_frozen", objects=frozen, ms=round((time.perf_counter() - start) * 1e3, 1))
    return frozen


class PauseWatch:
    """A gc callback that times each collection and logs the long ones (module docstring)."""

    def __init__(self, min_ms: float = PAUSE_LOG_MS) -> None:
        self.min_ms = min_ms
        self.longest_ms = 0.0  # the longest collection seen
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        ms = (time.perf_counter() - self._started) * 1e3
        self.longest_ms = max(self.longest_ms, ms)
        if ms >= self.min_ms:
            log.info(
                "gc_pause",
                ms=round(ms, 1),
                generation=info.get("generation"),
                collected=info.get("collected"),
            )

    def close(self) -> None:
        """Stop watching; idempotent."""
        if self in gc.callbacks:
            gc.callbacks.remove(self)


def watch_pauses(min_ms: float = PAUSE_LOG_MS) -> PauseWatch:
    """Log every collection of `min_ms` or more from now on (close() the result to stop)."""
    watch = PauseWatch(min_ms)
    gc.callbacks.append(watch)
    return watch


__all__ = ["PAUSE_LOG_MS", "PauseWatch", "freeze_startup_heap", "watch_pauses"]
