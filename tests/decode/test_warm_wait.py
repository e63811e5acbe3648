"""--warm-wait: while the batch is empty and a sequence handed off early awaits its KV, the torch
thread is kept awake; it is free again as soon as the loop has a step for it, and the tokens are
those of the reference. Real parts as in test_early_handoff (the tiny model, a shared-memory
producer pool); the thread's being awake is seen on the thread itself."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from common.model import reference
from common.protocol import Finish, KvReady, Tokens
from decode_server.requests import DecodeRequests
from decode_server.warm import warm_wait
from tests.support.decode import GREEDY, PROMPT, FakeLink, Side, early


def _torch_thread_busy(rt) -> bool:  # type: ignore[no-untyped-def]
    """Whether the torch thread is inside a job now: a probe job does not start within 50 ms."""
    started = threading.Event()
    rt.executor.submit(started.set)
    return not started.wait(0.05)


async def test_the_torch_thread_stays_awake_for_an_early_handoff_and_decodes_the_reference(
    side: Side, link: FakeLink, rt
):
    table = DecodeRequests(rt, max_batch=8, warm_wait=True)
    h = side.prefill("w1", PROMPT, GREEDY)
    loop = asyncio.create_task(table.run())
    try:
        await asyncio.sleep(0.05)
        assert table.engine.warm_waits == 0  # nothing expected: it sleeps on its queue
        table.handoff(link, early(h))
        async with asyncio.timeout(10):
            while table.engine.warm_waits == 0:
                await asyncio.sleep(0.005)
        assert await asyncio.to_thread(_torch_thread_busy, rt)  # kept awake, in its wait
        table.kv_ready(link, KvReady(request_id="w1", first_token=h.first_token))
        async with asyncio.timeout(30):
            while not link.of(Finish):
                assert not loop.done(), loop.exception()
                await asyncio.sleep(0.01)
        # nothing expected any more: the thread goes back to sleeping on its queue
        assert not await asyncio.to_thread(_torch_thread_busy, rt)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    tokens = [h.first_token] + [t for m in link.of(Tokens) for t in m.tokens]
    assert tokens == reference.generate(rt.model, PROMPT, GREEDY, block_size=rt.layout.block_size)
    side.producer.allocator.free("w1")
    assert rt.allocator.num_free == rt.allocator.total


async def test_a_warm_wait_frees_the_thread_once_work_comes(rt):  # type: ignore[no-untyped-def]
    work = asyncio.Event()
    waiting = asyncio.create_task(warm_wait(work, rt.executor, max_s=30.0))
    async with asyncio.timeout(10):  # until its job holds the thread
        while not await asyncio.to_thread(_torch_thread_busy, rt):
            assert not waiting.done(), waiting
    work.set()
    async with asyncio.timeout(5):
        await waiting  # it returned on the work, long before its 30 s
    ran = await asyncio.wrap_future(rt.executor.submit(lambda: "ran"))
    assert ran == "ran"
