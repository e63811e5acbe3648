"""DecodeRequests (the decode's request table) driven through a fake link: HANDOFF → pull →
RELEASE → batch → TOKENS/FINISH, capacity, abort and link loss, with real forward passes."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import Error, ErrorCode, Finish, Release, Tokens
from decode_server.requests import DecodeRequests
from tests.support.decode import FakeLink, Side, decode_until, open_consumer

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def table(rt):  # type: ignore[no-untyped-def]
    requests = DecodeRequests(rt, max_batch=8)
    yield requests
    assert rt.allocator.num_free == rt.allocator.total, "a test left decode blocks owned"


def _errors(link: FakeLink) -> list[tuple[str, str | None]]:
    return [(e.code, e.request_id) for e in link.of(Error)]


async def test_a_handoff_is_released_at_once_and_decodes_to_the_reference(
    side: Side, link, table, rt
):
    prompt = [5, 17, 99, 3, 42, 8, 250]
    h = side.prefill("r1", prompt, GREEDY)
    table.handoff(link, h)
    assert link.of(Release) == [Release(request_id="r1", event_slot=-1)]  # CPU: before any step
    assert len(table) == 1 and link.handoffs == 1
    await decode_until(table, lambda: link.of(Finish))
    tokens = [h.first_token] + [t for m in link.of(Tokens) for t in m.tokens]
    want = reference.generate(rt.model, prompt, GREEDY, block_size=rt.layout.block_size)
    assert tokens == want
    assert link.of(Finish)[0].usage.completion_tokens == GREEDY.max_tokens
    side.producer.allocator.free("r1")


def test_no_capacity_now_is_no_capacity_and_too_big_ever_is_bad_request(
    side: Side, link, table, rt
):
    params = SamplingParams(max_tokens=40)  # 3 + 39 positions: 11 blocks of 4 each
    handoffs = [side.prefill(f"r{i}", [1, 2, 3], params) for i in range(3)]
    for h in handoffs:
        table.handoff(link, h)
    assert _errors(link) == [(ErrorCode.NO_CAPACITY, "r2")]  # 24 blocks: two fit, not three
    assert len(table) == 2
    huge = side.prefill("big", [1, 2, 3], SamplingParams(max_tokens=200))
    table.handoff(link, huge)
    assert _errors(link)[-1] == (ErrorCode.BAD_REQUEST, "big")
    assert table.drop_peer(link) == 2  # the link ends: both sequences go, blocks freed
    for h in [*handoffs, huge]:
        side.producer.allocator.free(h.request_id)


def test_request_ids_are_per_link(side: Side, link, table, rt):
    other = FakeLink("link-b", open_consumer(side, rt.pool))
    h = side.prefill("same", [4, 5], GREEDY)
    table.handoff(link, h)
    table.handoff(link, h)
    assert _errors(link) == [(ErrorCode.BAD_REQUEST, "same")]  # in flight on this link
    table.handoff(other, h)
    assert _errors(other) == [] and len(table) == 2  # another link may use the same id
    assert table.drop_peer(other) == 1 and len(table) == 1
    table.abort(link, "same")
    assert len(table) == 0
    table.abort(link, "same")
    assert _errors(link)[-1] == (ErrorCode.CACHE_NOT_EXIST, "same")
    other.consumer.close()
    side.producer.allocator.free("same")


def test_a_bad_handoff_is_refused_without_taking_blocks(side: Side, link, table, rt):
    h = side.prefill("r", [1, 2, 3, 4, 5], GREEDY)
    bad = type(h)(**{**{f: getattr(h, f) for f in h.__struct_fields__}, "block_ids": [0]})
    table.handoff(link, bad)
    assert _errors(link) == [(ErrorCode.BAD_REQUEST, "r")]
    assert link.of(Release) == [] and len(table) == 0
    side.producer.allocator.free("r")


def test_a_handoff_with_max_tokens_0_is_refused(side: Side, link, table, rt):
    """max_tokens 0 (prompt logprobs only) is answered by the prefill alone: a HANDOFF of it
    would reserve fewer blocks than its prompt holds."""
    h = side.prefill("r0", [1, 2, 3, 4, 5], GREEDY)
    scored = SamplingParams(max_tokens=0, prompt_logprobs=1)
    bad = type(h)(**{**{f: getattr(h, f) for f in h.__struct_fields__}, "sampling": scored})
    table.handoff(link, bad)
    assert _errors(link) == [(ErrorCode.BAD_REQUEST, "r0")]
    assert link.of(Release) == [] and len(table) == 0
    side.producer.allocator.free("r0")


async def test_a_sequence_aborted_mid_step_keeps_its_blocks_until_the_step_returns(
    side: Side, link, table, rt
):
    """The step in flight may still write the sequence's KV slot: a pull into its blocks, were
    they freed and handed to another request, would race that write."""
    table.handoff(link, side.prefill("r1", [5, 6, 7], GREEDY))
    gate = threading.Event()
    held = asyncio.ensure_future(rt.run(gate.wait, 30))  # the torch thread is busy
    loop = asyncio.create_task(table.run())
    for _ in range(3):
        await asyncio.sleep(0)  # the loop takes r1 into a step, queued behind `held`
    table.abort(link, "r1")
    assert len(table) == 0 and "link-a/r1" in rt.allocator  # still under the step
    gate.set()
    await held
    try:
        async with asyncio.timeout(30):
            while "link-a/r1" in rt.allocator:
                await asyncio.sleep(0.005)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    assert link.of(Tokens) == []  # the aborted sequence's token was dropped
    side.producer.allocator.free("r1")


def test_a_links_warm_pull_on_cpu_takes_no_block_and_posts_nothing(side: Side, rt, table):
    link = FakeLink("link-w", open_consumer(side, rt.pool))
    free = rt.allocator.num_free
    table.warm_pull(link)  # nothing to warm where the copy runs inline
    assert rt.allocator.num_free == free and "warm-pull@link-w" not in rt.allocator
    assert link.frames == []
