"""KVProducer's lease bookkeeping and REGISTER payload, on a real shm pool (CPU: no event ring)."""

from __future__ import annotations

from common.ipc.events import CpuEventRing
from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.protocol import decode, encode
from common.transfer import KVProducer

LAYOUT = PoolLayout(
    num_blocks=8, num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32"
)


def _producer() -> KVProducer:
    return KVProducer(
        KVPool.create(LAYOUT), BlockAllocator(LAYOUT.num_blocks), "shm", event_slots=2
    )


def test_register_names_the_pool_once_exported_and_carries_its_memfd():
    p = _producer()
    reg, fds = p.register()
    again, fds_again = p.register()
    assert decode(encode(reg)) == reg and again == reg  # one export, re-sent per link
    assert len(fds) == 1 and fds == fds_again and reg.event_count == 0
    assert reg.descriptors()[0] == p.region.desc and reg.layout == LAYOUT.to_wire()
    p.close()
    p.close()


def test_cpu_has_no_event_slots_and_slot_verbs_ignore_minus_one():
    p = _producer()
    assert p.acquire_slot() == -1 and p.event_slots == 0
    p.record(-1)
    p.quarantine(-1, "r1", "link-1")
    p.drop_slot(-1)
    assert not p.ack_late(-1, "r1")
    p.close()


def test_leases_end_by_release_by_link_loss_or_by_deadline():
    p = _producer()
    alloc = p.allocator
    for rid, link, deadline in (("a", "l1", 10.0), ("b", "l1", 20.0), ("c", "l2", 5.0)):
        alloc.allocate(rid, 2)
        p.lease(rid, link, deadline)
    assert alloc.num_leased == 6
    assert p.released("a", -1) and not p.released("a", -1)  # a late second RELEASE frees nothing
    assert p.expired(6.0) == ["c"]  # only what is due, and freed
    assert p.link_lost("l1") == ["b"]
    assert alloc.num_free == alloc.total
    p.close()


def test_a_quarantined_slot_is_freed_only_for_the_request_it_was_quarantined_for():
    p = _producer()
    p.events = CpuEventRing(2)  # slot bookkeeping as on CUDA
    slot = p.acquire_slot()
    assert slot is not None and slot >= 0
    p.quarantine(slot, "r2", "link-1")
    assert not p.ack_late(slot, "r1") and p.events.free_count == 1  # another request's RELEASE
    assert p.ack_late(slot, "r2") and p.events.free_count == 2
    assert not p.ack_late(slot, "r2")  # once


def test_a_lost_link_frees_only_the_slots_quarantined_for_its_own_requests():
    """Two decodes: one's link ends; a slot quarantined for a request of the other may still be
    waited on by that decode, so it stays out of use until that decode answers."""
    p = _producer()
    p.events = CpuEventRing(2)
    mine, theirs = p.acquire_slot(), p.acquire_slot()
    assert mine is not None and theirs is not None and {mine, theirs} == {0, 1}
    p.quarantine(mine, "r1", "link-1")
    p.quarantine(theirs, "r2", "link-2")
    p.link_lost("link-1")
    assert p.events.free_count == 1 and p.acquire_slot() == mine
    assert not p.ack_late(theirs, "r1")  # still r2's
    p.link_lost("link-2")
    assert p.events.free_count == 1  # `mine` is taken again; `theirs` freed with its link
    p.close()
