"""The stream-ordered pull's bookkeeping without CUDA: a sequence joins the batch before its copy
is reported complete, RELEASE goes out exactly once and only after it, and blocks are freed
exactly once and never while the copy may still write them (abort, link loss, a failed copy, a
sequence that finishes first).

The one fake is the CUDA event a pull records (none can exist on a machine without CUDA): the
copy itself runs for real on the CPU, and the KVConsumer's waiter thread, in-flight count and
drain, the engine and DecodeRequests are the daemon's own.
"""

from __future__ import annotations

import asyncio
import os

from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import Error, ErrorCode, Finish, Release, Tokens
from decode_server.requests import DecodeRequests
from tests.support.decode import PROMPT, FakeLink, LaterConsumer, Side, decode_until

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


async def _until(cond) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(10):
        while not cond():
            await asyncio.sleep(0.005)


async def test_a_sequence_joins_and_decodes_before_its_pull_is_reported_and_release_waits(
    side: Side, dlink, table, rt
):
    h = side.prefill("r1", PROMPT, GREEDY)
    table.handoff(dlink, h)
    (event,) = dlink.consumer.events
    assert len(table) == 1 and dlink.consumer.pulls_in_flight == 1  # joined at once
    assert dlink.of(Release) == []  # the copy is not known complete: no RELEASE yet
    await decode_until(table, lambda: dlink.of(Tokens))
    assert len(event.waited_by) == 1 and event.waited_by[0].startswith("pdkv-decode-torch")
    event.complete()
    await dlink.consumer.drain()
    assert dlink.of(Release) == [Release(request_id="r1", event_slot=-1)]
    await decode_until(table, lambda: dlink.of(Finish))
    tokens = [h.first_token] + [t for m in dlink.of(Tokens) for t in m.tokens]
    assert tokens == reference.generate(rt.model, PROMPT, GREEDY, block_size=rt.layout.block_size)
    assert dlink.of(Release) == [Release(request_id="r1", event_slot=-1)]  # exactly once
    side.producer.allocator.free("r1")


async def test_abort_during_the_pull_keeps_the_blocks_until_the_copy_is_done(
    side: Side, dlink, table, rt
):
    table.handoff(dlink, side.prefill("r1", PROMPT, GREEDY))
    table.abort(dlink, "r1")
    assert len(table) == 0
    assert "link-d/r1" in rt.allocator  # the copy may still write them
    table.handoff(dlink, side.prefill("r1", PROMPT, GREEDY))  # same id while its copy runs
    assert [(e.code, e.request_id) for e in dlink.of(Error)] == [(ErrorCode.BAD_REQUEST, "r1")]
    dlink.consumer.events[0].complete()
    await dlink.consumer.drain()
    assert dlink.of(Release) == [Release(request_id="r1", event_slot=-1)]
    assert "link-d/r1" not in rt.allocator  # freed once, by the completion
    side.producer.allocator.free("r1")


async def test_link_loss_drains_the_pull_before_dropping_and_frees_once(
    side: Side, dlink, table, rt
):
    table.handoff(dlink, side.prefill("r1", PROMPT, GREEDY))
    event = dlink.consumer.events[0]
    asyncio.get_running_loop().call_later(0.05, event.complete)
    await dlink.consumer.drain()  # the server's _end_link: drain, then drop
    assert dlink.consumer.pulls_in_flight == 0 and len(dlink.of(Release)) == 1
    assert table.drop_peer(dlink) == 1
    assert len(table) == 0
    side.producer.allocator.free("r1")


async def test_a_copy_that_fails_on_the_device_fails_its_request_alone(
    side: Side, dlink, table, rt
):
    table.handoff(dlink, side.prefill("r1", PROMPT, GREEDY))
    dlink.consumer.events[0].complete(RuntimeError("CUDA error: an illegal memory access"))
    await dlink.consumer.drain()
    assert [(e.code, e.request_id) for e in dlink.of(Error)] == [(ErrorCode.INTERNAL, "r1")]
    assert dlink.of(Release) == [] and len(table) == 0
    side.producer.allocator.free("r1")


async def test_a_sequence_that_finishes_before_its_pull_is_reported_is_freed_after_it(
    side: Side, dlink, table, rt
):
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    table.handoff(dlink, side.prefill("r1", PROMPT, params))
    await decode_until(table, lambda: dlink.of(Finish))
    assert "link-d/r1" in rt.allocator and dlink.of(Release) == []
    dlink.consumer.events[0].complete()
    await _until(lambda: dlink.of(Release))
    assert "link-d/r1" not in rt.allocator and len(dlink.of(Release)) == 1
    side.producer.allocator.free("r1")


async def test_a_request_with_nothing_to_decode_finishes_only_after_its_pull(
    side: Side, dlink, table, rt
):
    """FINISH lets the prefill free its blocks: never before the copy that reads them is done."""
    table.handoff(dlink, side.prefill("r1", PROMPT, SamplingParams(max_tokens=1)))
    assert len(table) == 0 and dlink.sent == []
    dlink.consumer.events[0].complete()
    await dlink.consumer.drain()
    assert [type(m) for m in dlink.sent] == [Release, Finish]
    side.producer.allocator.free("r1")


async def test_a_transfer_without_an_event_joins_the_batch_only_once_it_landed(side: Side, rt):
    reg, fds = side.producer.register()
    consumer = LaterConsumer.open(reg, lambda n: [os.dup(fd) for fd in fds[:n]], rt.pool)
    consumer.pending = []
    link = FakeLink("link-n", consumer)
    table = DecodeRequests(rt, max_batch=8)
    try:
        h = side.prefill("r1", PROMPT, GREEDY)
        table.handoff(link, h)
        assert len(table) == 0 and link.sent == []  # its blocks are not here: not in the batch
        consumer.land()
        assert link.of(Release) == [Release(request_id="r1", event_slot=-1)] and len(table) == 1
        await decode_until(table, lambda: link.of(Finish))
        tokens = [h.first_token] + [t for m in link.of(Tokens) for t in m.tokens]
        assert tokens == reference.generate(
            rt.model, PROMPT, GREEDY, block_size=rt.layout.block_size
        )
    finally:
        consumer.close()
        side.producer.allocator.free("r1")
    assert rt.allocator.num_free == rt.allocator.total
