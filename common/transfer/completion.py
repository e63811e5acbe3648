"""Observe stream-ordered copies completing, off the event loop (the consumer's RELEASE signal).

`CompletionWaiter` is one thread per KVConsumer: `watch(event, done)` queues an event recorded
after a pull's copy; the thread calls `event.synchronize()` on each in turn (a blocking-sync event
sleeps the thread instead of spinning a core) and hands `done(None)`, or `done(exc)` when the wait
failed, back to the loop with `call_soon_threadsafe`. Pulls on one stream complete in the order
they were enqueued, so one FIFO thread observes each as soon as it is done. Nothing here is on the
decode's critical path: the decode's compute stream waits on the same event on the GPU; the host
learns of the completion only to send RELEASE.

The event is anything with `synchronize()` (a torch.cuda.Event in the daemon; the tests, on a
machine without CUDA, pass a fake one).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)
Done = Callable[[BaseException | None], None]


class Waitable(Protocol):
    def synchronize(self) -> None: ...


class CompletionWaiter:
    """One daemon thread that reports queued events' completion to the loop, in FIFO order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "pdkv-pull-waiter") -> None:
        self._loop = loop
        self._queue: queue.SimpleQueue[tuple[Waitable, Done] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, event: Waitable, done: Done) -> None:
        """Call `done` on the loop once `event` completes (or `done(exc)` if waiting failed)."""
        self._queue.put((event, done))

    def close(self, timeout: float = 1.0) -> None:
        """Stop the thread once it has reported what was queued before; idempotent."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, done = item
            error: BaseException | None = None
            try:
                event.synchronize()
            except Exception as exc:  # a failed copy (sticky CUDA error): that pull fails
                error = exc
            try:
                self._loop.call_soon_threadsafe(done, error)
            except RuntimeError:  # the loop is closed: nobody is left to tell
                log.warning("pull_completion_after_loop_closed")
                return


__all__ = ["CompletionWaiter", "Done", "Waitable"]
