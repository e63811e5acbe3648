"""Every way an early-handed-off request can end on the prefill side, and what it leaves: its
blocks freed once and never under its forward, its event slot free again (quarantined only while
the decode may wait on it, and only until the decode answers), an ABORT only to a decode that
may hold the request.

Real parts: the tiny model's runtime on CPU, the prefill's RequestPipeline and PrefillBatcher
(its forward runs when the test starts the batcher), the producer with the slot bookkeeping of
an event ring (CpuEventRing: CUDA's, with no-op records). The one fake is the link: it records
what the pipeline sends, and the test delivers the decode's answers.
"""

from __future__ import annotations

import asyncio

import pytest

from common.protocol import Abort, Error, ErrorCode, Handoff, KvReady, Release
from prefill_server.request import RequestFailed
from tests.support.prefill_pipeline import SLOTS, Setup, cancelled


async def test_a_refused_early_handoff_then_the_client_leaving_gets_no_abort_and_no_quarantine(
    cfg_rt,  # type: ignore[no-untyped-def]
):
    """The decode answered NO_CAPACITY (it holds nothing) and the request ends before the relay
    read that: an ABORT would be answered CACHE_NOT_EXIST, never RELEASE, and a slot
    quarantined for it would stay out of use until the link ends."""
    s = Setup(*cfg_rt)
    task = s.start("r1")
    await s.until(lambda: s.link.of(Handoff, "r1"))
    assert s.link.of(Handoff, "r1")[0].first_token is None  # the forward has not run
    s.pipeline.deliver(Error(code=ErrorCode.NO_CAPACITY, message="full", request_id="r1"))
    await cancelled(task)
    assert s.link.of(Abort, "r1") == []
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


async def test_the_client_leaving_before_the_first_token_aborts_and_frees_the_slot_at_once(
    cfg_rt,  # type: ignore[no-untyped-def]
):
    s = Setup(*cfg_rt)
    task = s.start("r1")
    await s.until(lambda: s.link.of(Handoff, "r1"))
    await cancelled(task)
    assert len(s.link.of(Abort, "r1")) == 1  # the decode reserved blocks for it
    assert s.link.of(KvReady, "r1") == []  # no KV was offered: the slot was never waited on
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


@pytest.mark.parametrize("answer", ["release", "cache_not_exist"])
async def test_after_its_first_token_an_aborted_request_holds_its_slot_until_the_decode_answers(
    cfg_rt,  # type: ignore[no-untyped-def]
    answer: str,
):
    s = Setup(*cfg_rt)
    task = s.start("r1")
    s.run_forwards()
    await s.until(lambda: s.link.of(KvReady, "r1"))  # the KV offered: the decode may wait now
    slot = s.link.of(Handoff, "r1")[0].event_slot
    await cancelled(task)
    assert len(s.link.of(Abort, "r1")) == 1
    assert s.slots_free() == SLOTS - 1  # quarantined: the decode may still wait on it
    again = s.start("r1")  # the same id before the decode answered: refused, not mixed up
    with pytest.raises(RequestFailed, match="already in flight"):
        await asyncio.wait_for(again, 10)
    if answer == "release":
        s.pipeline.deliver(Release(request_id="r1", event_slot=slot))
    else:
        s.pipeline.deliver(Error(code=ErrorCode.CACHE_NOT_EXIST, message="gone", request_id="r1"))
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


async def test_a_link_lost_during_the_forward_frees_the_blocks_only_after_it(
    cfg_rt,  # type: ignore[no-untyped-def]
):
    """The blocks of an early HANDOFF are not leased before their KV is written: losing the link
    must not free them under the forward that writes them (a new request could get them)."""
    s = Setup(*cfg_rt)
    task = s.start("r1")
    await s.until(lambda: s.link.of(Handoff, "r1"))
    s.link.ready.clear()
    s.pipeline.link_lost("link-1", "test")
    assert "r1" in s.rt.allocator and s.rt.allocator.num_leased == 0  # still its own
    s.pipeline.deliver(Release(request_id="r1", event_slot=0))  # a stray one: late, harmless
    assert "r1" in s.rt.allocator
    s.run_forwards()
    with pytest.raises(RequestFailed) as info:
        await asyncio.wait_for(task, 10)
    assert info.value.code == ErrorCode.LINK_LOST
    assert s.link.of(KvReady, "r1") == [] and s.link.of(Abort, "r1") == []
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


async def test_a_stale_release_of_another_request_leaves_a_quarantined_slot_quarantined(
    cfg_rt,  # type: ignore[no-untyped-def]
):
    """r2 ended while its decode may wait on its slot (quarantined). A RELEASE that names that
    slot for another request (r1's, late: its slot was freed when the decode answered it with
    ERROR, and taken since) must not free it: only r2's answer, or the link's end, does."""
    s = Setup(*cfg_rt)
    task = s.start("r2")
    s.run_forwards()
    await s.until(lambda: s.link.of(KvReady, "r2"))
    slot = s.link.of(Handoff, "r2")[0].event_slot
    await cancelled(task)
    assert s.slots_free() == SLOTS - 1
    s.pipeline.deliver(Release(request_id="r1", event_slot=slot))  # no longer in flight
    assert s.slots_free() == SLOTS - 1  # still r2's: its decode may still wait on it
    s.pipeline.deliver(Release(request_id="r2", event_slot=slot))
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()
