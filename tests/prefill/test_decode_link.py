"""The prefill's reconnecting link: stop() ends it for good, whatever the loop is doing."""

from __future__ import annotations

import asyncio

from common.allocator import BlockAllocator
from common.config import PrefillConfig
from common.kvpool import KVPool, PoolLayout
from common.transfer import KVProducer
from prefill_server.link import DecodeLink


def _link(tmp_path, lost: list[str]) -> DecodeLink:
    layout = PoolLayout(
        num_blocks=4, num_layers=1, num_kv_heads=1, head_dim=8, block_size=2, dtype="float32"
    )
    pool = KVPool.create(layout)
    producer = KVProducer(pool, BlockAllocator(layout.num_blocks), "shm", event_slots=1)
    cfg = PrefillConfig(runtime_dir=tmp_path, link_socket=tmp_path / "absent.sock")
    return DecodeLink(
        cfg,
        fingerprint="x",
        compat={},
        backend="shm",
        producer=producer,
        on_message=lambda m: None,
        on_lost=lambda link_id, reason: lost.append(reason),
    )


async def test_stop_ends_a_link_that_keeps_failing_to_connect(tmp_path):
    # connect() fails at once (no socket), so stop()'s cancel often lands in the same loop turn
    # as the failure: on Python 3.11 that cancel can be lost, and only the stop flag ends the loop.
    for i in range(40):
        link = _link(tmp_path, [])
        link.start()
        await asyncio.sleep(0.001 * (i % 8))
        async with asyncio.timeout(3):
            await link.stop()
        assert link._task is not None and link._task.done()
        assert link.state == "down"
        assert "FileNotFoundError" in link.last_error or link.last_error == ""
