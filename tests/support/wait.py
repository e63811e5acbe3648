"""Waiting on a condition with a deadline instead of sleeping a fixed time and then checking."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(fn: Callable[[], T], *, timeout: float = 30.0, every: float = 0.05, what: str = "") -> T:
    """Call fn until it returns something truthy; AssertionError with the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (OSError, TimeoutError) as exc:
            last = exc
        if last and not isinstance(last, BaseException):
            return last  # type: ignore[return-value]
        time.sleep(every)
    raise AssertionError(f"not reached within {timeout}s: {what or fn} (last: {last!r})")


async def until(
    fn: Callable[[], T], *, timeout: float = 30.0, every: float = 0.01, what: str = ""
) -> T:
    """poll() on an event loop: await fn() truthy, the loop running meanwhile."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"not reached within {timeout}s: {what or fn} (last: {last!r})")
