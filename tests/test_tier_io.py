"""The decode's write-back naming (common/kv/tier_io.Conversation): the blocks it reports as they
fill carry the names the prefill gives the next turn's prompt (block_names over prompt + answer),
each once, only once its KV is written, on the sequence's own pool blocks."""

from __future__ import annotations

import random

import pytest

from common.kv.blockhash import block_names
from common.kv.tier_io import Conversation

BS = 4
SEED = b"s" * 16


@pytest.mark.parametrize("prompt_len", [0, 3, 4, 9, 12])
def test_filled_blocks_are_named_as_the_next_prompt_names_them(prompt_len: int) -> None:
    rng = random.Random(prompt_len)
    prompt = [rng.randrange(100) for _ in range(prompt_len)]
    names = block_names(prompt, BS, SEED)
    conv = Conversation(prompt, names[-1] if names else SEED, BS)
    blocks = list(range(100, 130))
    generated: list[int] = []
    got: list[tuple[bytes, int]] = []
    for _ in range(30):
        generated.append(rng.randrange(100))
        written = prompt_len + len(generated) - 1  # the newest token's KV is the next step's
        got += conv.filled(generated, written, blocks)
        whole = block_names(prompt + generated[:-1], BS, SEED)
        assert [n for n, _ in got] == whole[len(names) :]  # named once each, none early
    assert [b for _, b in got] == blocks[len(names) : len(names) + len(got)]
    assert len(got) == (prompt_len + 29) // BS - len(names)


def test_a_restore_waits_for_the_write_back_still_reading_its_block(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A block freed and taken again (the pool's cache evicted it) while its write-back is still
    queued on the busy torch thread: the restore into it waits, so the tier keeps the block's
    own bytes under its name, not the restored ones."""
    import asyncio
    import hashlib
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import numpy as np
    import torch

    from common.kv.host_tier import HostTier
    from common.kv.pool import KVPool, PoolLayout
    from common.kv.tier_io import PoolTier

    layout = PoolLayout(
        num_blocks=8, num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32"
    )
    pool = KVPool.create(layout)
    pool.tensor.copy_(torch.randn(layout.shape))
    path = Path(f"/dev/shm/pdkv-test-tierio-{os.getpid()}")
    tier = HostTier.open(path, slot_bytes=layout.block_nbytes, capacity_bytes=8 << 20)
    pt = PoolTier(tier, pool, SEED)
    old, new = (hashlib.blake2b(x, digest_size=16).digest() for x in (b"old", b"new"))
    torch_thread = ThreadPoolExecutor(1)
    busy = threading.Event()
    try:
        want_old = pt.rows_np[3].copy()
        assert pt.write([(new, 5)]) == 1  # another block, in the tier already
        torch_thread.submit(busy.wait)  # a forward runs
        pt.write_later(torch_thread, [(old, 3)])  # block 3's write-back, queued behind it

        async def restore_then_release() -> int:
            task = asyncio.ensure_future(pt.restore_async([new], [3]))
            await asyncio.sleep(0.2)
            assert not task.done()  # waiting for the write-back
            busy.set()
            return await task

        assert asyncio.run(restore_then_release()) == 1
        assert np.array_equal(pt.rows_np[3], pt.rows_np[5])  # restored
        (hit,) = tier.lookup([old])
        assert np.array_equal(tier.slots[hit.slot], want_old)  # stored as it was
    finally:
        busy.set()
        torch_thread.shutdown()
        pt.close()
        path.unlink(missing_ok=True)
