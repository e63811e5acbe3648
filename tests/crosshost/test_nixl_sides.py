"""The NIXL transfer sides with two real agents in two processes (UCX over TCP/shared memory,
CPU pools): the prefill's NixlProducer in a child, the decode's NixlConsumer here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
import pytest_asyncio
import torch

from common.errors import IpcError
from common.kv.pool import KVPool, block_runs
from common.protocol import PushFailed, decode
from common.transfer.interface import AFTER_DONE, PullPlan
from common.transfer.nixl_agent import NixlAgent, NixlTransferError
from common.transfer.nixl_sides import byte_runs
from tests.support.nixl_peer import LAYOUT, Link, pattern

SEED = 3
# one prefill process per transfer mode for the whole module: starting one costs seconds
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["pull", "push"])
async def link(request) -> AsyncIterator[Link]:  # type: ignore[no-untyped-def]
    local = KVPool.create(LAYOUT)
    agent = NixlAgent("decode", local.tensor, asyncio.get_running_loop())
    try:
        link = await Link.connect(request.param, SEED, local, agent)
        yield link
        await link.close()
    finally:
        agent.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_runs_are_coalesced_where_blocks_are_adjacent_in_both_pools():
    assert block_runs([3, 4, 5, 9, 10], [10, 11, 12, 2, 4]) == [
        (3, 10, 3),
        (9, 2, 1),
        (10, 4, 1),
    ]
    bn = LAYOUT.block_nbytes
    assert byte_runs([3, 4], [7, 8], bn, 1000, 0) == [(1000 + 3 * bn, 7 * bn, 2 * bn)]


async def test_the_blocks_arrive_byte_for_byte(link: Link):
    src, dst = [3, 4, 5, 9, 0], [10, 11, 12, 2, 23]
    assert await link.pull(src, dst) is None
    expected = pattern(LAYOUT, SEED)
    assert torch.equal(link.local.tensor[dst], expected[src])
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in dst]
    assert link.local.tensor[untouched].abs().sum() == 0
    assert link.consumer.pulls_in_flight == 0


async def test_many_transfers_in_flight_each_complete_once(link: Link):
    fut = [link.pull([i], [LAYOUT.num_blocks - 1 - i]) for i in range(8)]
    assert await asyncio.gather(*fut) == [None] * 8
    expected = pattern(LAYOUT, SEED)
    for i in range(8):
        assert torch.equal(link.local.tensor[LAYOUT.num_blocks - 1 - i], expected[i])


async def test_a_failed_transfer_fails_that_request_only(link: Link):
    consumer = link.consumer
    if consumer.region.transfer == "pull":
        # a real NIXL failure: the READ names memory the peer never registered (its REGISTER
        # gave a wrong address)
        region = consumer.region
        consumer.region = msgspec.structs.replace(region, addr=region.addr + region.nbytes)
        try:
            err = await link.pull([1], [1])
        finally:
            consumer.region = region
        assert isinstance(err, NixlTransferError)
    else:
        # the prefill refuses a WRITE outside the decode's pool and says so (PUSH_FAILED)
        done: list[BaseException | None] = []
        plan = PullPlan([1], [LAYOUT.num_blocks + 5], -1)  # past the consumer's own checks
        assert consumer.start(plan, done.append) is AFTER_DONE
        failed = await _push_failed(link)
        assert consumer.handle_frame(failed, lambda msg: None)
        assert len(done) == 1 and isinstance(done[0], NixlTransferError)
        assert "outside" in str(done[0])
    assert await link.pull([2, 3], [5, 6]) is None  # the link goes on
    assert torch.equal(link.local.tensor[[5, 6]], pattern(LAYOUT, SEED)[[2, 3]])


async def test_a_pull_of_ids_outside_either_pool_never_starts(link: Link):
    done: list[BaseException | None] = []
    with pytest.raises(IpcError, match="source block ids"):
        link.consumer.pull([LAYOUT.num_blocks], [0], -1, done.append)
    with pytest.raises(IpcError, match="destination block ids repeat"):
        link.consumer.pull([0, 1], [3, 3], -1, done.append)
    assert done == [] and link.consumer.pulls_in_flight == 0


async def test_a_push_of_blocks_not_leased_to_the_link_is_refused(link: Link):
    """The prefill writes only blocks leased to the link the PUSH came on: block N-2 is leased
    to another link and block N-1 to none, so PUSHes naming them get PUSH_FAILED, and the
    decode's blocks stay as they were."""
    if link.consumer.region.transfer == "pull":
        pytest.skip("a pull link has no PUSH")
    consumer, last = link.consumer, LAYOUT.num_blocks - 1
    for src, why in (([0, last - 1], "leased to another link"), ([last], "is not leased")):
        done: list[BaseException | None] = []
        before = link.local.tensor[[20, 21]].clone()
        consumer.pull(src, [20, 21][: len(src)], -1, done.append)
        assert consumer.handle_frame(await _push_failed(link), lambda msg: None)
        assert len(done) == 1 and isinstance(done[0], NixlTransferError), done
        assert why in str(done[0])
        assert torch.equal(link.local.tensor[[20, 21]], before)


async def _push_failed(link: Link) -> PushFailed:
    """The next frame the prefill sent back, which must be a PUSH_FAILED (within 30 s)."""
    conn = link.child.conn
    assert await link.loop.run_in_executor(None, conn.poll, 30), "no PUSH_FAILED came back"
    kind, frame = conn.recv()
    failed = decode(frame)  # type: ignore[arg-type]
    assert kind == "frame" and isinstance(failed, PushFailed)
    return failed


async def test_drain_waits_for_a_read_started_as_the_last_one_completed(link: Link):
    """A HANDOFF handled in the loop turn that completes the last READ starts a new one after
    drain was woken: drain must wait for that one too, not fail it (and so free its blocks)
    while it still writes them."""
    if link.consumer.region.transfer == "push":
        pytest.skip("a push link holds what it awaits past drain (test_nixl_gaps.py)")
    first: list[BaseException | None] = []
    later: list[BaseException | None] = []

    def first_done(exc: BaseException | None) -> None:
        first.append(exc)
        for _ in range(3):  # enough READs that they outlast drain's wake-up on this host
            for b in range(LAYOUT.num_blocks):
                link.consumer.pull([b], [b], -1, later.append)

    link.consumer.pull([1], [1], -1, first_done)
    await link.consumer.drain()
    assert first == [None]
    assert later == [None] * 3 * LAYOUT.num_blocks
    assert torch.equal(link.local.tensor, pattern(LAYOUT, SEED))


async def test_drain_waits_for_reads_and_holds_pushes_still_awaited_for_the_grace(link: Link):
    done: list[BaseException | None] = []
    if link.consumer.region.transfer == "pull":
        link.consumer.pull([1, 2], [7, 8], -1, done.append)
        await link.consumer.drain()  # the READ writes into our blocks: drain waits for it
        assert done == [None]
        assert torch.equal(link.local.tensor[[7, 8]], pattern(LAYOUT, SEED)[[1, 2]])
        return
    post = link.consumer._post
    link.consumer._post = lambda msg: None  # the PUSH never reaches the prefill
    link.consumer.pull([1], [1], -1, done.append)
    await link.consumer.drain(push_grace_s=0.3)
    assert done == [] and link.consumer.pulls_in_flight == 1  # its blocks stay held
    async with asyncio.timeout(10):
        while not done:
            await asyncio.sleep(0.02)
    assert len(done) == 1 and isinstance(done[0], NixlTransferError)
    assert link.consumer.pulls_in_flight == 0
    link.consumer._post = post


@pytest.mark.asyncio(loop_scope="function")
async def test_two_links_on_one_decode_agent_never_take_each_others_pushes():
    """Each link numbers its pushes from the decode agent's one counter, and a notification
    counts only from the agent it names: two prefills pushing at once each land their own
    bytes (with per-link tags both would send `pdkv-push:1`)."""
    local = KVPool.create(LAYOUT)
    agent = NixlAgent("decode", local.tensor, asyncio.get_running_loop())
    links: list[Link] = []
    try:
        links = [await Link.connect("push", seed, local, agent) for seed in (5, 6)]
        got = await asyncio.gather(
            links[0].pull([0, 1], [2, 3]),
            links[1].pull([0, 1], [12, 13]),
            links[0].pull([4], [8]),
            links[1].pull([4], [18]),
        )
        assert got == [None] * 4
        assert torch.equal(local.tensor[[2, 3, 8]], pattern(LAYOUT, 5)[[0, 1, 4]])
        assert torch.equal(local.tensor[[12, 13, 18]], pattern(LAYOUT, 6)[[0, 1, 4]])
    finally:
        for link in links:
            await link.close()
        agent.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_close_answers_what_was_queued_just_before_it():
    """close() right after expect()/transfer(): the worker finds them queued with its stop;
    each `done` still runs, once, with the agent's closing error."""
    local = KVPool.create(LAYOUT)
    agent = NixlAgent("decode", local.tensor, asyncio.get_running_loop())
    got: list[BaseException | None] = []
    agent.expect("nobody", b"pdkv-push:1", got.append)
    agent.transfer("READ", "nobody", [(agent.addr, 0, LAYOUT.block_nbytes)], b"", got.append)
    agent.close()
    for _ in range(100):
        if len(got) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(got) == 2 and all(isinstance(e, NixlTransferError) for e in got), got


# ---- the early handoff on a push link: the PUSH goes at HANDOFF, the WRITE at KV_READY --------
async def _ask(link: Link, cmd: str, arg: object) -> object:
    """One of nixl_peer's request commands; its answer (a PUSH_FAILED instead fails the test)."""
    link.child.conn.send((cmd, arg))
    kind, value = await link.recv()
    assert kind in ("ids", "ok"), (kind, decode(value) if kind == "frame" else value)  # type: ignore[arg-type]
    return value


async def _until(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(600):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _push_only(link: Link) -> None:
    if link.consumer.region.transfer == "pull":
        pytest.skip("a pull link READs on KV_READY: nothing is asked for early")


async def test_an_early_push_waits_for_its_kv_then_lands(link: Link, monkeypatch):
    """The PUSH of an early HANDOFF reaches the prefill before the request's KV is written: the
    prefill holds it (nothing lands, no PUSH_FAILED) until it leases the blocks, then WRITEs.
    KV_READY (`start`) tells the agent's worker to poll closely: the WRITE lands about then."""
    _push_only(link)
    consumer, dst = link.consumer, 22
    hurried: list[None] = []
    real_hurry = consumer.agent.hurry
    monkeypatch.setattr(consumer.agent, "hurry", lambda: (hurried.append(None), real_hurry()))
    writes = await _ask(link, "writes", None)
    ids = await _ask(link, "allocate", "early-1")
    plan = consumer.early(consumer.plan(ids, [dst], -1), "early-1")  # type: ignore[arg-type]
    assert plan.tag is not None and consumer.pulls_in_flight == 1
    before = link.local.tensor[dst].clone()
    done: list[BaseException | None] = []
    assert hurried == []
    assert consumer.start(plan, done.append) is AFTER_DONE
    assert hurried == [None]
    # the prefill answers after it took the PUSH: held, neither written nor refused
    assert await _ask(link, "writes", None) == writes
    assert done == [] and torch.equal(link.local.tensor[dst], before)
    await _ask(link, "lease", "early-1")  # due: written once the first token went out
    assert await _ask(link, "writes", None) == writes
    assert done == [] and torch.equal(link.local.tensor[dst], before)
    await _ask(link, "flush", "early-1")
    await _until(lambda: done, "the held push to land")
    assert done == [None] and await _ask(link, "writes", None) == writes + 1
    assert torch.equal(link.local.tensor[dst], pattern(LAYOUT, SEED)[ids[0]])  # type: ignore[index]
    await _ask(link, "end", "early-1")


async def test_an_early_push_that_lands_before_kv_ready_is_read_starts_at_once(link: Link):
    """The WRITE goes before KV_READY, so its notification can be here first: `start` then
    reports the blocks here at once."""
    _push_only(link)
    consumer, dst = link.consumer, 21
    ids = await _ask(link, "allocate", "early-2")
    plan = consumer.early(consumer.plan(ids, [dst], -1), "early-2")  # type: ignore[arg-type]
    await _ask(link, "lease", "early-2")
    await _ask(link, "flush", "early-2")
    await _until(lambda: consumer.pulls_in_flight == 0, "the notification")
    done: list[BaseException | None] = []
    assert consumer.start(plan, done.append) is AFTER_DONE
    assert done == [None]  # inside start
    assert torch.equal(link.local.tensor[dst], pattern(LAYOUT, SEED)[ids[0]])  # type: ignore[index]
    with pytest.raises(Exception, match="started or discarded already"):
        consumer.start(plan, done.append)
    await _ask(link, "end", "early-2")


async def test_an_early_push_of_a_request_that_ended_is_never_written(link: Link):
    """The request ends before its KV is written (its ABORT comes instead of KV_READY): the
    prefill drops the held PUSH, the decode forgets it and may free its blocks at once, and a
    later request on the same source block does not get the old PUSH written."""
    _push_only(link)
    consumer, dst = link.consumer, 20
    ids = await _ask(link, "allocate", "early-3")
    plan = consumer.early(consumer.plan(ids, [dst], -1), "early-3")  # type: ignore[arg-type]
    await _ask(link, "end", "early-3")
    done: list[BaseException | None] = []
    assert consumer.discard(plan, done.append, may_land=False) is False
    assert consumer.pulls_in_flight == 0
    before = link.local.tensor[dst].clone()
    writes = await _ask(link, "writes", None)
    assert await _ask(link, "allocate", "early-3b") == ids  # the same block, another request
    await _ask(link, "lease", "early-3b")
    await _ask(link, "flush", "early-3b")
    assert await _ask(link, "writes", None) == writes  # the old PUSH was not posted: never lands
    assert done == [] and torch.equal(link.local.tensor[dst], before)
    await _ask(link, "end", "early-3b")


async def test_a_discarded_early_push_that_may_land_holds_its_blocks_until_it_does(link: Link):
    """A request that ends after the prefill may have sent the WRITE (a first token the decode
    refuses, its link lost): the blocks stay held until the notification comes."""
    _push_only(link)
    consumer, dst = link.consumer, 19
    ids = await _ask(link, "allocate", "early-4")
    plan = consumer.early(consumer.plan(ids, [dst], -1), "early-4")  # type: ignore[arg-type]
    done: list[BaseException | None] = []
    assert consumer.discard(plan, done.append, may_land=True) is True
    assert done == [] and consumer.pulls_in_flight == 1
    await _ask(link, "lease", "early-4")  # KV_READY went; then the request ends before flush:
    await _ask(link, "end", "early-4")  # the decode awaits the WRITE, so it goes all the same
    await _until(lambda: done, "the discarded push to land")
    assert done == [None] and consumer.pulls_in_flight == 0
    assert torch.equal(link.local.tensor[dst], pattern(LAYOUT, SEED)[ids[0]])  # type: ignore[index]


async def test_an_early_push_naming_blocks_not_its_own_is_refused(link: Link):
    """Only the request's own unleased blocks are held for it: block N-2 is another link's."""
    _push_only(link)
    consumer, last = link.consumer, LAYOUT.num_blocks - 1
    ids = await _ask(link, "allocate", "early-5")
    assert ids == [last]
    plan = consumer.early(consumer.plan([last - 1], [18], -1), "early-5")
    done: list[BaseException | None] = []
    consumer.start(plan, done.append)
    assert consumer.handle_frame(await _push_failed(link), lambda msg: None)
    assert len(done) == 1 and "leased to another link" in str(done[0])
    await _ask(link, "end", "early-5")
