"""--prefill-first-ms: before a step the decode waits while a sequence handed to it early still
awaits its KV (a prefill computes it), at most the bound, and steps at least once between holds;
a sequence that ends, or arrives during a hold, does not prolong it. The tokens are those of the
reference. Real parts as in test_early_handoff (the tiny model's forwards, a shared-memory
producer pool)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable

import pytest

from common.model import reference
from common.protocol import Finish, KvReady, Tokens
from common.transfer import KVConsumer
from decode_server.config import DecodeConfig
from decode_server.prefill_first import PrefillFirst
from decode_server.requests import DecodeRequests
from tests.support.decode import GREEDY, PROMPT, FakeLink, Side, early

OTHER = [9, 33, 71, 2, 140]


@contextlib.asynccontextmanager
async def running(table: DecodeRequests) -> AsyncIterator[asyncio.Task[None]]:
    loop = asyncio.create_task(table.run())
    try:
        yield loop
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


async def until(cond: Callable[[], bool], loop: asyncio.Task[None], timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            assert not loop.done(), loop.exception()
            await asyncio.sleep(0.005)


def tokens_of(link: FakeLink, rid: str, first: int) -> list[int]:
    return [first] + [t for m in link.of(Tokens) if m.request_id == rid for t in m.tokens]


def finished(link: FakeLink, rid: str) -> bool:
    return any(f.request_id == rid for f in link.of(Finish))


def ref(rt, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    return reference.generate(rt.model, prompt, GREEDY, block_size=rt.layout.block_size)


async def test_no_step_runs_while_a_prompt_handed_off_early_is_computed(side: Side, link, rt):
    table = DecodeRequests(rt, max_batch=8, prefill_first_ms=10_000)
    first = table.prefill_first
    assert first is not None
    h1, h2 = side.prefill("d1", PROMPT, GREEDY), side.prefill("e1", OTHER, GREEDY)
    table.handoff(link, h1)  # decoding at once
    table.handoff(link, early(h2))  # its KV "being computed"
    async with running(table) as loop:
        await until(lambda: first.holds == 1, loop)
        await asyncio.sleep(0.2)
        assert table.engine.steps == 0 and not link.of(Tokens)  # held: d1 waits for e1's forward
        table.kv_ready(link, KvReady(request_id="e1", first_token=h2.first_token))
        await until(lambda: finished(link, "d1") and finished(link, "e1"), loop)
    assert first.timeouts == 0 and first.held_s >= 0.2
    assert tokens_of(link, "d1", h1.first_token) == ref(rt, PROMPT)
    assert tokens_of(link, "e1", h2.first_token) == ref(rt, OTHER)
    for rid in ("d1", "e1"):
        side.producer.allocator.free(rid)
    assert rt.allocator.num_free == rt.allocator.total


async def test_a_hold_ends_at_its_bound_and_every_step_follows_one(side: Side, link, rt):
    """A KV that never comes holds each step only `max_ms`: the decoding sequence still runs to
    its reference tokens, one step per hold."""
    table = DecodeRequests(rt, max_batch=8, prefill_first_ms=30)
    first = table.prefill_first
    assert first is not None
    h1, h2 = side.prefill("d1", PROMPT, GREEDY), side.prefill("e1", OTHER, GREEDY)
    table.handoff(link, early(h2))
    table.handoff(link, h1)
    async with running(table) as loop:
        await until(lambda: finished(link, "d1"), loop)
    steps = GREEDY.max_tokens - 1  # the first token came with the HANDOFF
    assert table.engine.steps == steps
    assert first.timeouts == first.holds == steps
    assert first.held_s >= steps * 0.03 * 0.9
    assert tokens_of(link, "d1", h1.first_token) == ref(rt, PROMPT)
    table.abort(link, "e1")
    for rid in ("d1", "e1"):
        side.producer.allocator.free(rid)
    assert rt.allocator.num_free == rt.allocator.total


async def test_an_abort_or_a_later_arrival_does_not_prolong_a_hold(side: Side, link, rt):
    """The hold waits for the sequences awaiting their KV when it began: one aborted meanwhile
    ends it, and one handed off during it is not waited for."""
    table = DecodeRequests(rt, max_batch=8, prefill_first_ms=10_000)
    first = table.prefill_first
    assert first is not None
    h1, h2 = side.prefill("d1", PROMPT, GREEDY), side.prefill("e1", OTHER, GREEDY)
    h3 = side.prefill("e2", [7, 7, 7], GREEDY)
    table.handoff(link, h1)
    table.handoff(link, early(h2))
    async with running(table) as loop:
        await until(lambda: first.holds == 1, loop)
        table.handoff(link, early(h3))  # arrives during the hold
        await asyncio.sleep(0.05)
        assert table.engine.steps == 0
        table.abort(link, "e1")  # the one the hold waits for ends: the hold ends
        await until(lambda: table.engine.steps >= 1, loop, timeout=5)
        # the next step holds again, for e2 now
        await until(lambda: first.holds == 2, loop, timeout=5)
        table.abort(link, "e2")
        await until(lambda: finished(link, "d1"), loop)
    assert first.timeouts == 0
    assert tokens_of(link, "d1", h1.first_token) == ref(rt, PROMPT)
    for rid in ("d1", "e1", "e2"):
        side.producer.allocator.free(rid)
    assert rt.allocator.num_free == rt.allocator.total


def test_a_hold_needs_a_positive_bound():
    with pytest.raises(ValueError, match="positive"):
        PrefillFirst(0)


class ElsewhereConsumer(KVConsumer):
    """A link whose prefill computes on another device (another GPU, another host): what a CPU
    machine cannot have, so the one fake here is its answer to shares_device."""

    @property
    def shares_device(self) -> bool:
        return False


async def test_a_prefill_on_another_device_is_not_waited_for(side: Side, rt):
    """Its forwards do not take turns with our steps: no hold for its early handoffs."""
    reg, fds = side.producer.register()
    consumer = ElsewhereConsumer.open(reg, lambda n: [os.dup(fd) for fd in fds[:n]], rt.pool)
    link = FakeLink("link-far", consumer)
    table = DecodeRequests(rt, max_batch=8, prefill_first_ms=10_000)
    first = table.prefill_first
    assert first is not None
    h1, h2 = side.prefill("d1", PROMPT, GREEDY), side.prefill("e1", OTHER, GREEDY)
    table.handoff(link, h1)
    table.handoff(link, early(h2))
    try:
        async with running(table) as loop:
            await until(lambda: finished(link, "d1"), loop, timeout=5)
        assert first.holds == 0
        assert tokens_of(link, "d1", h1.first_token) == ref(rt, PROMPT)
        table.abort(link, "e1")
    finally:
        consumer.close()
    for rid in ("d1", "e1"):
        side.producer.allocator.free(rid)
    assert rt.allocator.num_free == rt.allocator.total


def test_the_hold_is_on_by_default_on_cuda_only(tmp_path):
    cfg = DecodeConfig(runtime_dir=tmp_path)
    assert (cfg.prefill_first_for("cuda"), cfg.prefill_first_for("cpu")) == (50.0, 0.0)
    explicit = DecodeConfig(runtime_dir=tmp_path, prefill_first_ms=0)
    assert explicit.prefill_first_for("cuda") == 0.0
