"""A prefill linked to several decodes: each request goes to the least loaded one that is up, and
a decode's NO_CAPACITY moves the request to another at once, its blocks' lease with it. The real
pipeline, model and batcher; the links are the fakes of tests.support.prefill_pipeline (they
record frames)."""

from __future__ import annotations

import asyncio

from common.protocol import (
    ErrorCode,
    Finish,
    Handoff,
    Pong,
    Release,
    Tokens,
    Usage,
    make_error,
)
from prefill_server.phase import Phase
from tests.support.prefill_pipeline import Setup


def _finish(rid: str) -> Finish:
    usage = Usage(prompt_tokens=20, completion_tokens=4)
    return Finish(request_id=rid, reason="length", usage=usage)


async def _answer(s: Setup, rid: str, handoff: Handoff) -> None:
    s.pipeline.deliver(Release(request_id=rid, event_slot=handoff.event_slot))
    s.pipeline.deliver(Tokens(request_id=rid, tokens=[5, 6, 7]))
    s.pipeline.deliver(_finish(rid))


async def test_requests_spread_by_load_and_skip_a_decode_that_is_down(cfg_rt) -> None:  # type: ignore[no-untyped-def]
    s = Setup(*cfg_rt, decodes=3)
    s.links[2].ready.clear()  # down: never chosen
    tasks = [s.start(f"r{i}") for i in range(2)]
    await s.until(lambda: all(s.sent(Handoff, f"r{i}") for i in range(2)))
    chosen = sorted(s.sent(Handoff, f"r{i}")[0][0] for i in range(2))
    assert chosen == ["link-1", "link-2"] and [lk.load.mine for lk in s.links] == [1, 1, 0]
    # link-1's decode reports 5 sequences of another prefill besides ours: the next two go to 2
    s.links[0].load.reported(Pong(seq=1, free_blocks=100, sequences=1 + 5))
    tasks += [s.start(f"r{i}") for i in range(2, 4)]
    await s.until(lambda: all(s.sent(Handoff, f"r{i}") for i in range(4)))
    assert [s.sent(Handoff, f"r{i}")[0][0] for i in (2, 3)] == ["link-2", "link-2"]
    assert [lk.load.mine for lk in s.links] == [1, 3, 0]
    s.run_forwards()
    for i in range(4):
        (_, first), *_ = s.sent(Handoff, f"r{i}")
        await s.until(lambda i=i: s.pipeline.requests[f"r{i}"].phase is Phase.LEASED)
        await _answer(s, f"r{i}", first)
    for task in tasks:
        frames = await asyncio.wait_for(task, 10)
        assert isinstance(frames[-1], Finish)
    assert [link.load.mine for link in s.links] == [0, 0, 0]  # ended requests count nowhere
    assert s.clean()
    await s.close()


async def test_no_capacity_moves_the_request_to_another_decode_at_once(cfg_rt) -> None:  # type: ignore[no-untyped-def]
    s = Setup(*cfg_rt, decodes=2)
    s.run_forwards()
    task = s.start("r1")
    await s.until(lambda: getattr(s.pipeline.requests.get("r1"), "phase", None) is Phase.LEASED)
    ((first_link, first),) = s.sent(Handoff, "r1")
    other = "link-2" if first_link == "link-1" else "link-1"
    assert s.rt.allocator.lease_of("r1").holder == first_link
    s.pipeline.deliver(make_error(ErrorCode.NO_CAPACITY, "full", "r1"))
    await s.until(lambda: len(s.sent(Handoff, "r1")) == 2)
    again = next(m for lk, m in s.sent(Handoff, "r1") if lk == other)
    assert again.first_token is not None and again.block_ids == first.block_ids
    assert s.rt.allocator.lease_of("r1").holder == other  # the lease moved with it
    assert [link.load.mine for link in s.links] == [int(other == "link-1"), int(other == "link-2")]
    await _answer(s, "r1", again)
    frames = await asyncio.wait_for(task, 10)
    assert isinstance(frames[-1], Finish)
    assert s.clean()
    await s.close()


async def test_a_decode_lost_before_the_kv_was_written_hands_the_request_to_another(cfg_rt) -> None:  # type: ignore[no-untyped-def]
    """No token of it has left the daemons when the link of its early HANDOFF is lost during
    the forward: it goes to another decode (with its first token) instead of failing."""
    s = Setup(*cfg_rt, decodes=2)
    task = s.start("r1")
    await s.until(lambda: s.sent(Handoff, "r1"))
    ((lost_id, early),) = s.sent(Handoff, "r1")
    assert early.first_token is None
    lost = next(link for link in s.links if link.link_id == lost_id)
    lost.ready.clear()
    s.pipeline.link_lost(lost_id, "test: decode killed")
    assert s.pipeline.requests["r1"].phase is Phase.REFUSED
    s.run_forwards()
    await s.until(lambda: len(s.sent(Handoff, "r1")) == 2)
    other, again = s.sent(Handoff, "r1")[-1] if lost_id == "link-1" else s.sent(Handoff, "r1")[0]
    assert other != lost_id and again.first_token is not None
    assert s.rt.allocator.lease_of("r1").holder == other
    await _answer(s, "r1", again)
    frames = await asyncio.wait_for(task, 10)
    assert isinstance(frames[-1], Finish)
    assert [t for f in frames if isinstance(f, Tokens) for t in f.tokens][1:] == [5, 6, 7]
    assert s.clean()
    await s.close()
