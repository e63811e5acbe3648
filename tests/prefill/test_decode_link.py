"""The prefill's reconnecting link: stop() ends it for good, whatever the loop is doing."""

from __future__ import annotations

import asyncio

from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.protocol import Message
from common.transfer import KVProducer
from prefill_server.config import PrefillConfig
from prefill_server.link import DecodeLink


class _Listener:
    """The link's listener: `on_frame` handles each frame; a lost link is ignored."""

    def __init__(self, on_frame=lambda m: None) -> None:  # type: ignore[no-untyped-def]
        self.on_frame = on_frame

    def deliver(self, msg: Message) -> None:
        self.on_frame(msg)

    def link_lost(self, link_id: str, reason: str) -> None:
        pass


def _link(tmp_path, address=None) -> DecodeLink:  # type: ignore[no-untyped-def]
    layout = PoolLayout(
        num_blocks=4, num_layers=1, num_kv_heads=1, head_dim=8, block_size=2, dtype="float32"
    )
    pool = KVPool.create(layout)
    producer = KVProducer(pool, BlockAllocator(layout.num_blocks), "shm", event_slots=1)
    cfg = PrefillConfig(runtime_dir=tmp_path, link_socket=tmp_path / "absent.sock")
    return DecodeLink(
        cfg,
        address,
        fingerprint="x",
        compat={},
        backend="shm",
        producer=producer,
    )


async def test_stop_ends_a_link_that_keeps_failing_to_connect(tmp_path):
    # connect() fails at once (no socket), so stop()'s cancel often lands in the same loop turn
    # as the failure: on Python 3.11 that cancel can be lost, and only the stop flag ends the loop.
    for i in range(40):
        link = _link(tmp_path)
        link.start(_Listener())
        await asyncio.sleep(0.001 * (i % 8))
        async with asyncio.timeout(3):
            await link.stop()
        assert link._task is not None and link._task.done()
        assert link.state == "down"
        assert "FileNotFoundError" in link.last_error or link.last_error == ""


async def test_a_frame_the_handler_fails_on_drops_the_link_and_it_reconnects(tmp_path):
    """An exception from a frame's handling (here the allocator's, for a RELEASE of a request
    that holds blocks but no lease) must not end the link's task: the prefill would stay up,
    its link shown up, and never hand anything off again."""
    from common.protocol import Release
    from tests.support.fakes import FakeDecode

    fake = FakeDecode(tmp_path / "d.sock").start()
    link = _link(tmp_path, str(fake.path))
    allocator = link.producer.allocator
    allocator.allocate("held", 1)  # allocated, not leased: still being prefilled
    link.start(_Listener(lambda m: link.producer.released(m.request_id, -1)))
    try:
        await link.wait_up(5)
        fake.send_all(Release(request_id="held"))
        async with asyncio.timeout(10):
            while link.connects < 2 or link.state != "up":
                await asyncio.sleep(0.01)
        assert "AllocatorError" in link.last_error
    finally:
        await link.stop()
        fake.stop()
