"""KV_LAUNCHED (v12) through the prefill's real pipeline: when it goes (between the early
HANDOFF and KV_READY, only for a plain greedy request that is all the daemon has in flight), and
every way such a request ends: its slot quarantined while the decode may wait on it, its blocks
its own until KV_READY (a link lost in between sends it to another decode).

Real parts as in test_early_endings (tests.support.prefill_pipeline): the tiny model on CPU, the
pipeline and batcher, a producer with an event ring's slot bookkeeping; the producer's mailbox is
a CPU tensor standing in for the GPU block a CUDA daemon reserves. The one fake is the link.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import Abort, Finish, Generate, Handoff, KvLaunched, KvReady, Release, Usage
from tests.support.prefill_pipeline import SLOTS, Setup

PROMPT = [3] * 20


def _with_mailbox(s: Setup) -> torch.Tensor:
    s.producer.mailbox = torch.full((SLOTS,), -1, dtype=torch.int64)
    return s.producer.mailbox


def _finish(rid: str) -> Finish:
    usage = Usage(prompt_tokens=len(PROMPT), completion_tokens=4)
    return Finish(request_id=rid, reason="length", usage=usage, timings={"decode_ms": 1.0})


def _types(link, rid: str) -> list[type]:  # type: ignore[no-untyped-def]
    return [type(m) for m in link.sent if getattr(m, "request_id", None) == rid]


async def test_kv_launched_goes_between_the_early_handoff_and_kv_ready_with_its_token(cfg_rt):  # type: ignore[no-untyped-def]
    s = Setup(*cfg_rt)
    mailbox = _with_mailbox(s)
    task = s.start("r1")
    await s.until(lambda: s.link.of(Handoff, "r1"))
    s.run_forwards()
    await s.until(lambda: s.link.of(KvReady, "r1"))
    assert _types(s.link, "r1") == [Handoff, KvLaunched, KvReady]
    slot = s.link.of(Handoff, "r1")[0].event_slot
    first = s.link.of(KvReady, "r1")[0].first_token
    assert mailbox[slot].item() == first  # the token the decode's first step reads
    assert s.rt.allocator.num_leased > 0  # leased at KV_READY, as after any early HANDOFF
    s.pipeline.deliver(Release(request_id="r1", event_slot=slot))
    s.pipeline.deliver(_finish("r1"))
    frames = await asyncio.wait_for(task, 10)
    timings = frames[-1].timings
    assert timings["launch_ahead_us"] >= 0 and timings["launch_send_us"] >= 0, timings
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


async def test_no_kv_launched_without_a_mailbox_or_with_other_requests_in_flight(cfg_rt):  # type: ignore[no-untyped-def]
    s = Setup(*cfg_rt)
    first = s.start("r1")
    await s.until(lambda: s.link.of(Handoff, "r1"))
    s.run_forwards()
    await s.until(lambda: s.link.of(KvReady, "r1"))
    assert s.link.of(KvLaunched, "r1") == []  # no mailbox: nothing to read the token from
    _with_mailbox(s)
    second = s.start("r2")  # r1 still in flight: its decode is busy, no use to launch early
    await s.until(lambda: s.link.of(KvReady, "r2"))
    assert s.link.of(KvLaunched, "r2") == []
    for rid, task in (("r1", first), ("r2", second)):
        slot = s.link.of(Handoff, rid)[0].event_slot
        s.pipeline.deliver(Release(request_id=rid, event_slot=slot))
        s.pipeline.deliver(_finish(rid))
        await asyncio.wait_for(task, 10)
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


async def test_a_link_lost_after_kv_launched_sends_the_request_to_another_decode(cfg_rt):  # type: ignore[no-untyped-def]
    """Between KV_LAUNCHED and KV_READY the blocks are still the request's own: losing the link
    neither frees them under the forward nor fails the request; it goes to the other decode
    with its first token, as an early offer whose link was lost does."""
    s = Setup(*cfg_rt, decodes=2)
    _with_mailbox(s)
    launched = s.pipeline.handoff.launched

    def launched_then_lost(req):  # type: ignore[no-untyped-def]
        launched(req)  # KV_LAUNCHED goes, then the link drops at once (a fault timed here)
        s.link.ready.clear()
        s.pipeline.link_lost("link-1", "test")
        assert "r1" in s.rt.allocator and s.rt.allocator.num_leased == 0  # still its own

    s.pipeline.handoff.launched = launched_then_lost  # type: ignore[method-assign]
    task = s.start("r1")
    await s.until(lambda: s.link.of(Handoff, "r1"))
    s.run_forwards()
    other = s.links[1]
    await s.until(lambda: other.of(Handoff, "r1"))
    (again,) = other.of(Handoff, "r1")
    assert again.first_token is not None  # offered again, its KV written
    assert s.link.of(KvLaunched, "r1") and s.link.of(KvReady, "r1") == []
    s.pipeline.deliver(Release(request_id="r1", event_slot=again.event_slot))
    s.pipeline.deliver(_finish("r1"))
    frames = await asyncio.wait_for(task, 10)
    assert isinstance(frames[-1], Finish)
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


@pytest.mark.parametrize("answer", ["release", "link_lost"])
async def test_a_first_token_that_stops_after_kv_launched_quarantines_the_slot_until_answered(
    cfg_rt,  # type: ignore[no-untyped-def]
    answer: str,
):
    """The decode may have queued its pull behind the slot: the ABORT must be answered (the
    decode sends RELEASE) or the link end before the slot is recorded again."""
    s = Setup(*cfg_rt)
    _with_mailbox(s)
    first = reference.generate(s.rt.model, PROMPT, SamplingParams(max_tokens=1))[0]
    msg = Generate(
        sampling=SamplingParams(max_tokens=4, stop_token_ids=[first]), prompt_tokens=PROMPT
    )

    async def run() -> list:
        return [m async for m in s.pipeline.run("r1", msg)]

    task = asyncio.create_task(run())
    await s.until(lambda: s.link.of(Handoff, "r1"))
    s.run_forwards()
    frames = await asyncio.wait_for(task, 10)
    assert frames[-1].reason == "stop" and frames[0].tokens == [first]
    assert _types(s.link, "r1") == [Handoff, KvLaunched, Abort]  # no KV_READY: it ended
    assert s.slots_free() == SLOTS - 1  # quarantined: the decode may wait on it
    if answer == "release":
        slot = s.link.of(Handoff, "r1")[0].event_slot
        s.pipeline.deliver(Release(request_id="r1", event_slot=slot))
    else:
        s.link.ready.clear()
        s.pipeline.link_lost("link-1", "test")
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()
