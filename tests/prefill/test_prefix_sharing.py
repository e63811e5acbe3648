"""The prefill pipeline's use of the prefix cache on real parts (the tiny model's runtime on CPU,
the batcher, the producer with an event ring's slot bookkeeping; the one fake is the link): a
block is shared only once its forward wrote it, and a request that ends never frees, or lets
anyone overwrite, a block another request shares."""

from __future__ import annotations

import asyncio

from common.kv.allocator import BlockState
from common.protocol import Abort, Finish, Handoff, KvReady, Release, Usage
from tests.support.prefill_pipeline import Setup, cancelled

PROMPT = [(11 * i + 5) % 256 for i in range(40)]  # 2 full blocks of 16, and a partial one


def _finish(rid: str) -> Finish:
    return Finish(
        request_id=rid, reason="length", usage=Usage(prompt_tokens=40, completion_tokens=4)
    )


async def _release(s: Setup, rid: str) -> None:
    await s.until(lambda: s.link.of(KvReady, rid))
    s.pipeline.deliver(Release(request_id=rid, event_slot=s.link.of(Handoff, rid)[0].event_slot))


async def test_a_block_is_not_shared_before_its_forward_wrote_it(cfg_rt) -> None:  # type: ignore[no-untyped-def]
    s = Setup(*cfg_rt)
    alloc = s.rt.allocator
    first = s.start("w1", prompt=PROMPT)
    await s.until(lambda: s.link.of(Handoff, "w1"))  # queued, its forward not run
    second = s.start("w2", prompt=PROMPT)
    await s.until(lambda: s.link.of(Handoff, "w2"))
    assert set(alloc.blocks_of("w1")).isdisjoint(alloc.blocks_of("w2"))
    assert s.pipeline.requests["w2"].cached_tokens == 0
    s.run_forwards()
    for rid in ("w1", "w2"):
        await _release(s, rid)
        s.pipeline.deliver(_finish(rid))
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert alloc.num_named == 2  # one copy of the two full blocks: the second stayed unnamed
    third = s.start("w3", prompt=PROMPT)
    await s.until(lambda: "w3" in s.pipeline.requests and s.link.of(Handoff, "w3"))
    assert s.pipeline.requests["w3"].cached_tokens == 32
    assert alloc.blocks_of("w3")[:2] == alloc.lookup(s.pipeline.prefix.names(PROMPT))
    await _release(s, "w3")
    s.pipeline.deliver(_finish("w3"))
    frames = await asyncio.wait_for(third, 10)
    assert frames[-1].usage.cached_tokens == 32
    assert s.clean(), (alloc, s.slots_free())
    await s.close()


async def test_an_aborted_request_leaves_shared_blocks_to_their_other_holder(cfg_rt) -> None:  # type: ignore[no-untyped-def]
    """a1 is leased to the decode (its KV offered, no RELEASE yet) and a2 shares its cached
    blocks, leased too; a1's client goes away: a1's blocks stay leased until the decode answers
    its ABORT (its pull may not have run), then the shared blocks stay LEASED to a2's reader,
    their bytes untouched, and no new request can get them."""
    s = Setup(*cfg_rt)
    alloc = s.rt.allocator
    prompt = [7, *PROMPT[1:]]
    s.run_forwards()
    first = s.start("a1", prompt=prompt, max_tokens=50)
    await s.until(lambda: s.link.of(KvReady, "a1"))  # written, named, leased
    second = s.start("a2", prompt=prompt, max_tokens=50)
    await s.until(lambda: s.link.of(KvReady, "a2"))
    shared = alloc.blocks_of("a2")[:2]
    assert shared == alloc.blocks_of("a1")[:2]
    assert s.pipeline.requests["a2"].cached_tokens == 32
    before = s.rt.pool.gather(shared).clone()
    await cancelled(first)
    assert len(s.link.of(Abort, "a1")) == 1
    mine = alloc.blocks_of("a1")
    assert alloc.lease_of("a1") is not None  # the decode may still pull them: kept
    grab = alloc.allocate("grab", alloc.num_free)  # every free block, cached ones included
    assert set(grab).isdisjoint(mine)
    alloc.free("grab")
    slot = s.link.of(Handoff, "a1")[0].event_slot
    s.pipeline.deliver(Release(request_id="a1", event_slot=slot))  # the decode answers the ABORT
    assert "a1" not in alloc
    assert all(alloc.state_of(b) is BlockState.LEASED for b in shared)
    assert all(alloc.holders_of(b) == ["a2"] for b in shared)
    grab = alloc.allocate("grab", alloc.num_free)
    assert set(grab).isdisjoint(shared)
    alloc.free("grab")
    assert s.rt.pool.gather(shared).equal(before)
    await _release(s, "a2")
    s.pipeline.deliver(_finish("a2"))
    frames = await asyncio.wait_for(second, 10)
    assert frames[-1].usage.cached_tokens == 32
    assert s.clean(), (alloc, s.slots_free())
    await s.close()
