"""NIXL transfers that outlive their link, with two real agents in two processes (CPU pools).

The fault is real: the peer's process is stopped (SIGSTOP, a host that hangs), so a transfer to
or from it stays in flight for as long as the test wants; nothing is faked. A transfer's `done`
must come only once NIXL has it over (completed, failed, or released by an abort), because the
decode frees the blocks it writes right after; a link that ends aborts what the prefill still
writes to its decode; and a link that ends never takes a peer agent from under a READ.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest_asyncio
import torch

from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.protocol import Message, Push, Registered, decode
from common.transfer.nixl_agent import NixlAgent
from common.transfer.nixl_sides import NixlProducer
from tests.support.nixl_peer import LAYOUT, Child, Link, pattern, serve_decode

SEED = 4
LAST = LAYOUT.num_blocks - 1
#: 64 blocks of 512 KiB: a WRITE of them cannot all sit in socket buffers while its target hangs
BIG = PoolLayout(
    num_blocks=64, num_layers=8, num_kv_heads=4, head_dim=64, block_size=32, dtype="float32"
)


async def _until(cond: Callable[[], object], what: str) -> None:
    async with asyncio.timeout(30):
        while not cond():
            await asyncio.sleep(0.01)
    assert cond(), what


@pytest_asyncio.fixture
async def decode_side() -> AsyncIterator[tuple[KVPool, NixlAgent]]:
    local = KVPool.create(LAYOUT)
    agent = NixlAgent("decode", local.tensor, asyncio.get_running_loop())
    yield local, agent
    agent.close()


async def test_a_read_that_outlives_drain_reports_only_once_it_is_over(decode_side):
    """The decode frees a sequence's blocks right after its pull's `done`: a READ still in
    flight when drain gives up must not report until NIXL has it over, and then with its
    bytes all there."""
    local, agent = decode_side
    link = await Link.connect("pull", SEED, local, agent)
    try:
        link.child.pause()
        peer = link.consumer.peer_agent
        seen: list[tuple[BaseException | None, int]] = []
        ids = list(range(LAST))
        link.consumer.pull(ids, ids, -1, lambda exc: seen.append((exc, agent.in_flight(peer))))
        await link.consumer.drain(read_timeout_s=0)  # the READ outlives it
        link.consumer.close()  # what the decode does next: the READ keeps the peer
        assert seen == [] and agent.in_flight(peer) == 1
        link.child.resume()
        await _until(lambda: seen, "the READ never reported")
        assert seen == [(None, 0)]  # done ran once NIXL had it over, not before
        assert torch.equal(local.tensor[:LAST], pattern(LAYOUT, SEED)[:LAST])
    finally:
        link.child.stop()


async def test_closing_a_link_leaves_its_read_in_flight_to_finish(decode_side):
    """close() after a drain that gave up must not take the peer from under a READ: the READ
    completes when the prefill answers, and only then reports."""
    local, agent = decode_side
    link = await Link.connect("pull", SEED, local, agent)
    try:
        link.child.pause()
        done: list[BaseException | None] = []
        link.consumer.pull([1, 2, 3], [7, 8, 9], -1, done.append)
        link.consumer.close()
        await asyncio.sleep(0.1)  # the close is queued to the worker before the prefill wakes
        assert done == []  # still in flight: nothing reported
        link.child.resume()
        await _until(lambda: done, "the READ never reported")
        assert done == [None]
        assert torch.equal(local.tensor[[7, 8, 9]], pattern(LAYOUT, SEED)[[1, 2, 3]])
    finally:
        link.child.stop()


async def test_a_link_ending_leaves_another_links_read_from_the_same_prefill_alone(decode_side):
    """A prefill that reconnects loads the same agent before its old link is torn down: ending
    the old link must not forget the agent the new link still reads from."""
    local, agent = decode_side
    old = await Link.connect("pull", SEED, local, agent)
    new = Link(old.child, old.reg, local, agent)
    try:
        old.child.pause()
        done: list[BaseException | None] = []
        new.consumer.pull([4, 5], [10, 11], -1, done.append)
        await old.consumer.drain()
        old.consumer.close()
        old.child.resume()
        await _until(lambda: done, "the READ never reported")
        assert done == [None]
        assert torch.equal(local.tensor[[10, 11]], pattern(LAYOUT, SEED)[[4, 5]])
    finally:
        await new.consumer.drain()
        new.consumer.close()
        old.child.stop()


async def test_a_push_awaited_when_its_link_ends_holds_its_blocks_until_the_write_lands(
    decode_side,
):
    """The decode frees a sequence's blocks right after its pull's `done`: a push the prefill
    has not written yet when the link ends may still land (the prefill aborts it only once it
    sees the loss), so `done` must wait for the WRITE (or the grace), never come at drain."""
    local, agent = decode_side
    link = await Link.connect("push", SEED, local, agent)
    try:
        link.child.pause()  # a prefill that has not run the WRITE yet
        seen: list[BaseException | None] = []
        link.consumer.pull([1, 2, 3], [7, 8, 9], -1, seen.append)
        await link.consumer.drain()
        link.consumer.close()  # what the decode does next
        await asyncio.sleep(0.2)
        assert seen == [] and link.consumer.pulls_in_flight == 1  # blocks 7-9 still held
        link.child.resume()  # the WRITE runs after all
        await _until(lambda: seen, "the push never reported")
        assert seen == [None]
        assert torch.equal(local.tensor[[7, 8, 9]], pattern(LAYOUT, SEED)[[1, 2, 3]])
    finally:
        link.child.stop()


async def test_a_push_in_flight_when_the_link_drops_is_aborted_by_the_prefill():
    loop = asyncio.get_running_loop()
    pool = KVPool.create(BIG)
    pool.tensor.copy_(pattern(BIG, SEED))
    alloc = BlockAllocator(BIG.num_blocks)
    producer = NixlProducer(pool, alloc, transfer="push", loop=loop)
    decode_host = Child(serve_decode, BIG)
    try:
        ok = decode(await decode_host.recv())
        assert isinstance(ok, Registered) and ok.nixl is not None
        decode_host.conn.send(("add", producer.register()[0].nixl))
        assert await decode_host.recv() == "ok"
        producer.connected(ok, "link-1")
        alloc.allocate("r1", BIG.num_blocks)
        producer.lease("r1", "link-1", float("inf"))
        decode_host.pause()
        replies: list[Message] = []
        ids = list(range(BIG.num_blocks))
        assert producer.handle_frame(
            Push(tag=1, src_ids=ids, dst_ids=ids), replies.append, "link-1"
        )
        peer = ok.nixl.agent
        await asyncio.sleep(0.2)
        assert producer.agent.in_flight(peer) == 1  # the decode hangs: the WRITE waits on it
        assert producer.link_lost("link-1") == ["r1"]
        await _until(lambda: not producer.agent.in_flight(peer), "the WRITE was left running")
        assert replies == []  # aborted, not failed: nothing goes to a link that is gone
        assert alloc.num_leased == 0
        assert producer.peers == {}  # the link's peer entry went with it
        # the next link loads the decode's agent again and writes through it
        decode_host.resume()
        producer.connected(ok, "link-2")
        assert producer.peers == {"link-2": peer}
        alloc.allocate("r2", 1)
        producer.lease("r2", "link-2", float("inf"))
        src = alloc.blocks_of("r2")
        assert producer.handle_frame(
            Push(tag=2, src_ids=src, dst_ids=[0]), replies.append, "link-2"
        )
        await _until(lambda: not producer.agent.in_flight(peer), "the second WRITE never ended")
        assert replies == []
        decode_host.conn.send(("blocks", [0]))
        got = await decode_host.recv()
        assert torch.equal(got[0], pattern(BIG, SEED)[src[0]])
    finally:
        decode_host.stop()
        producer.close()
