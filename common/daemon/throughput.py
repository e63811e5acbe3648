"""Requests served and tokens per second, for `pdkv status`: no I/O, O(1) per update."""

from __future__ import annotations

import collections
import time


class Throughput:
    """Counts finished requests (ever) and generated tokens per second over the last `window_s`
    seconds, in one-second buckets; the rate of a daemon younger than the window is over its age."""

    def __init__(self, window_s: int = 60) -> None:
        self.window_s = window_s
        self.served = 0
        self.started = time.monotonic()
        self._buckets: collections.deque[list[int]] = collections.deque()  # [second, tokens]

    def add(self, tokens: int, *, requests: int = 0, now: float | None = None) -> None:
        """Record `tokens` generated and `requests` finished at `now` (default: the clock)."""
        self.served += requests
        second = int(time.monotonic() if now is None else now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += tokens
        else:
            self._buckets.append([second, tokens])
        self._expire(second)

    def tokens_per_s(self, now: float | None = None) -> float:
        """Tokens per second over the last `window_s` seconds (or the daemon's age, if shorter)."""
        now = time.monotonic() if now is None else now
        self._expire(int(now))
        span = min(float(self.window_s), max(now - self.started, 1.0))
        return round(sum(n for _, n in self._buckets) / span, 1)

    def _expire(self, second: int) -> None:
        while self._buckets and self._buckets[0][0] <= second - self.window_s:
            self._buckets.popleft()
