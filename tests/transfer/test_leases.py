"""The producer's lease check, the one a PUSH must pass: its blocks leased to the link that
asks (Producer.leased_to, over a real allocator)."""

from __future__ import annotations

from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.transfer import KVProducer

LAYOUT = PoolLayout(
    num_blocks=8, num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32"
)


def test_blocks_must_be_leased_to_the_link_that_names_them():
    alloc = BlockAllocator(LAYOUT.num_blocks)
    producer = KVProducer(KVPool.create(LAYOUT), alloc, "shm", event_slots=0)
    mine = alloc.allocate("mine", 3)  # 0, 1, 2
    producer.lease("mine", "link-1", 10.0)
    theirs = alloc.allocate("theirs", 1)  # 3
    producer.lease("theirs", "link-2", 10.0)
    owned = alloc.allocate("computing", 1)  # 4: OWNED, not handed off yet
    assert producer.leased_to(mine, "link-1") is None
    assert producer.leased_to(mine + theirs, None) is None  # any link
    assert producer.leased_to(mine + theirs, "link-1") == "block 3 is leased to another link"
    assert producer.leased_to(owned, "link-1") == "block 4 is not leased"
    assert producer.leased_to([7], "link-1") == "block 7 is not leased"  # free
    assert producer.leased_to([8], "link-1") == "block 8 is outside the pool of 8"
    producer.released("mine", -1)
    assert producer.leased_to(mine, "link-1") == "block 0 is not leased"  # RELEASEd: gone
    producer.link_lost("link-2")
    assert producer.leased_to(theirs, None) == "block 3 is not leased"
    producer.close()
