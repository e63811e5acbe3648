"""Keeping the torch thread awake while the decode expects work (`--warm-wait`).

After an early HANDOFF the decode knows a sequence will join within about one prefill forward,
and its batch may be empty meanwhile. Left alone, the torch thread sleeps on its queue and the
CPU it ran on goes idle; the first step then starts on a cold core: on the H200's host its
launch took 0.5-1 ms (`first_launch_us`) against ~0.25 ms for a warm step, and the 2nd token
waits for it. So while the batch is empty and a sequence awaits its KV, the torch thread waits
in short timed waits instead (`SPIN_WAIT_S`: each one a futex wait with the GIL released, so
the loop thread is not held up), and returns at once when the loop has a step for it.

Off on the CPU backend (auto): there the prefill's forward runs on the same few cores and
every wake-up would be taken from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import Executor

#: one timed wait of the torch thread: short enough that its core does not go deeply idle
SPIN_WAIT_S = 50e-6
#: the longest one warm wait lasts before the loop looks again whether it is still expected
MAX_WARM_S = 0.1


def _stay_awake(stop: threading.Event, until: float) -> None:
    """Torch thread: short timed waits until `stop` or the monotonic time `until`."""
    while not stop.wait(SPIN_WAIT_S) and time.monotonic() < until:
        pass


async def warm_wait(work: asyncio.Event, executor: Executor, max_s: float = MAX_WARM_S) -> None:
    """Wait for `work` (at most `max_s`) with the torch thread (`executor`'s one worker) kept
    awake meanwhile; on return it is free again within one SPIN_WAIT_S, so a step submitted next
    starts at once, on a warm core."""
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    awake = loop.run_in_executor(executor, _stay_awake, stop, time.monotonic() + max_s)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max_s):
                await work.wait()
    finally:
        stop.set()  # not awaited: the next job queues behind it and runs as it returns
        awake.add_done_callback(lambda f: f.cancelled() or f.exception())


__all__ = ["MAX_WARM_S", "SPIN_WAIT_S", "warm_wait"]
