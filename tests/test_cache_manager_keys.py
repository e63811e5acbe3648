"""CacheManager's cache keys: a local blocks cache names the blocks that hold a token sequence's
full blocks (the prefix cache's names, equal to a prefill daemon's for the same model and layout)
and finds them by name; the KV found is the KV a forward wrote there."""

from __future__ import annotations

import pytest
import torch

from common.errors import IpcError
from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.kv.prefix_cache import PrefixCache
from common.model.loader import tiny_model
from common.model.paged import slots_for
from common.transfer.cache_manager import CacheManager

BLOCK = 4


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    return tiny_model()


def _pool(model) -> KVPool:  # type: ignore[no-untyped-def]
    layers, heads, dim = model.kv_layout_args()
    layout = PoolLayout(
        num_blocks=12,
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=dim,
        block_size=BLOCK,
        dtype="float32",
    )
    return KVPool.create(layout)


def test_named_blocks_are_found_by_the_daemon_s_names(model) -> None:  # type: ignore[no-untyped-def]
    mgr = CacheManager()
    pool = _pool(model)
    cache = mgr.register_blocks_cache(pool, model=model.fingerprint)
    prompt = [(3 * i + 1) % 256 for i in range(14)]  # 3 full blocks and 2 tokens
    blocks = [7, 2, 9, 4]
    model.prefill(torch.tensor(prompt), slots_for(blocks, 0, len(prompt), BLOCK), pool.tensor)
    names = mgr.block_names(cache, prompt)
    daemon = PrefixCache(BlockAllocator(12), pool.layout, model.fingerprint, True)
    assert names == list(daemon.names(prompt)) and len(names) == 3
    assert mgr.name_blocks(cache, blocks[:3], names) == 3
    other = prompt[:8] + [200] * 6  # shares two full blocks
    hit = mgr.lookup_blocks(cache, mgr.block_names(cache, other))
    assert hit == [7, 2]
    # the KV found is that prefix's: a fresh prefill of it writes the same values
    ref = model.new_kv_cache(12, BLOCK)
    model.prefill(torch.tensor(other[:8]), slots_for([0, 1], 0, 8, BLOCK), ref)
    torch.testing.assert_close(pool.tensor[hit], ref[[0, 1]], rtol=1e-5, atol=1e-5)
    assert mgr.name_blocks(cache, [5], names[:1]) == 0  # one copy per name
    mgr.unname_blocks(cache, [2])  # its KV is about to change
    assert mgr.lookup_blocks(cache, names) == [7]
    other_model = mgr.register_blocks_cache(_pool(model), model="another")
    assert mgr.block_names(other_model, prompt)[0] != names[0]
    mgr.close()


def test_keys_are_refused_where_there_are_none(model) -> None:  # type: ignore[no-untyped-def]
    mgr = CacheManager()
    cache = mgr.register_blocks_cache(_pool(model))
    payload, fds = mgr.export_cache(cache)
    remote = mgr.import_cache(payload, list(fds))
    with pytest.raises(IpcError, match="no block names"):
        mgr.lookup_blocks(remote, [b"x" * 16])
    plain = mgr.register_cache(torch.zeros(4))
    with pytest.raises(IpcError, match="no block names"):
        mgr.block_names(plain, [1, 2, 3, 4])
    with pytest.raises(IpcError, match="2 block ids but 1 names"):
        mgr.name_blocks(cache, [1, 2], [b"x" * 16])
    with pytest.raises(IpcError, match="repeat"):
        mgr.name_blocks(cache, [1, 1], [b"x" * 16, b"y" * 16])
    mgr.close()
