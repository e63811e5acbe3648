"""The status counters: requests served ever, tokens per second over the last minute."""

from __future__ import annotations

from common.daemon.throughput import Throughput


def test_rate_is_over_the_window_and_forgets_old_seconds() -> None:
    t = Throughput(window_s=10)
    t.started = 1000.0
    t.add(30, requests=1, now=1001.2)
    t.add(20, requests=2, now=1001.9)
    assert t.served == 3
    assert t.tokens_per_s(now=1005.0) == 10.0  # 50 tokens over the 5 s the daemon has lived
    assert t.tokens_per_s(now=1020.0) == 0.0  # both seconds left the window
    t.add(40, now=1025.5)
    assert t.tokens_per_s(now=1026.0) == 4.0  # 40 tokens over the full 10 s window
    assert t.served == 3
