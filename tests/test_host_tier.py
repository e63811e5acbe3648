"""The host KV tier (common/kv/host_tier.py) with real processes on a real /dev/shm region:
concurrent writers and readers never read wrong bytes, a writer SIGKILLed mid-write or while it
holds the lock leaves nothing readable and an index that checks, a torn write and a corrupted slot
are misses (counted), LRU eviction, a restart maps the same tier, a tier too small is refused."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from common.kv.host_index import NONE
from common.kv.host_tier import HostTier, TierError, checksum

SLOT = 4096
CTX = mp.get_context("spawn")


def name(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def block(i: int) -> np.ndarray:
    """Block i's bytes: derived from i, so a reader knows what it must have read."""
    return np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8)


@pytest.fixture
def path() -> Iterator[Path]:
    p = Path(f"/dev/shm/pdkv-test-tier-{os.getpid()}-{os.urandom(4).hex()}")
    yield p
    p.unlink(missing_ok=True)


def tier(path: Path, slots: int = 8) -> HostTier:
    return HostTier.open(path, slot_bytes=SLOT, capacity_bytes=slots * SLOT)


# -- child processes (spawned: module-level functions) ----------------------------------------------
def _writer_reader(path: str, seed: int, n: int, q: mp.Queue) -> None:
    t = tier(Path(path), 16)
    rng = np.random.default_rng(seed)
    wrong = good = 0
    dst = np.empty(SLOT, np.uint8)
    for _ in range(n):
        i = int(rng.integers(0, 40))
        if rng.random() < 0.5:
            t.store(name(i), block(i))
        else:
            for hit in t.lookup([name(i)]):
                if t.read(hit, dst):
                    good += 1
                    wrong += not np.array_equal(dst, block(i))
    t.verify()
    q.put((good, wrong, t.counts["checksum_failures"]))
    t.close()


def _half_write_then_hang(path: str, i: int, ready: mp.Event) -> None:
    t = tier(Path(path))
    slot, _gen = t.reserve(name(i))
    t.slots[slot][: SLOT // 2] = block(i)[: SLOT // 2]
    ready.set()
    signal.pause()  # SIGKILLed here, mid-write


def _die_holding_the_lock(path: str, ready: mp.Event) -> None:
    t = tier(Path(path))
    with t._locked() as index:  # mid-update: the LRU list half unlinked
        index._lru_unlink(index.lookup([name(0)])[0].slot)
        ready.set()
        signal.pause()


def _store_and_exit(path: str, ids: list[int]) -> None:
    t = tier(Path(path))
    for i in ids:
        assert t.store(name(i), block(i))
    t.close()


def _run(target, *args) -> mp.Process:  # type: ignore[no-untyped-def]
    p = CTX.Process(target=target, args=args)
    p.start()
    return p


# -- tests ------------------------------------------------------------------------------------------
def test_concurrent_writers_and_readers_read_only_right_bytes(path: Path) -> None:
    tier(path, 16).close()
    q = CTX.Queue()
    procs = [_run(_writer_reader, str(path), seed, 400, q) for seed in range(4)]
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(good for good, _, _ in results) > 100  # they did read each other's blocks
    assert [wrong for _, wrong, _ in results] == [0, 0, 0, 0]
    assert [bad for _, _, bad in results] == [0, 0, 0, 0]
    t = tier(path, 16)
    t.verify()
    assert t.stats()["evictions"] > 0  # 40 names in 16 slots
    t.close()


def test_writer_killed_mid_write_leaves_nothing_readable(path: Path) -> None:
    t = tier(path)
    ready = CTX.Event()
    p = _run(_half_write_then_hang, str(path), 7, ready)
    assert ready.wait(60)
    assert t.lookup([name(7)]) == []  # WRITING: invisible while its writer lives
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert t.lookup([name(7)]) == []
    t.verify()
    assert t.reclaim() == 1  # its writer is dead: the slot is free again
    t.verify()
    assert t.store(name(7), block(7))
    (hit,) = t.lookup([name(7)])
    dst = np.empty(SLOT, np.uint8)
    assert t.read(hit, dst) and np.array_equal(dst, block(7))
    t.close()


def test_a_killed_writers_name_can_be_written_again_without_reclaim(path: Path) -> None:
    t = tier(path)
    ready = CTX.Event()
    p = _run(_half_write_then_hang, str(path), 3, ready)
    assert ready.wait(60)
    assert t.reserve(name(3))[0] == NONE  # being written by a live writer
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert t.store(name(3), block(3))  # its dead writer's slot is dropped on the way
    t.verify()
    t.close()


def test_holder_killed_mid_update_is_rebuilt(path: Path) -> None:
    t = tier(path)
    for i in range(4):
        t.store(name(i), block(i))
    ready = CTX.Event()
    p = _run(_die_holding_the_lock, str(path), ready)
    assert ready.wait(60)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    hits = t.lookup([name(i) for i in range(4)])  # takes the lock: finds it dirty, rebuilds
    assert [h.name for h in hits] == [name(i) for i in range(4)]
    t.verify()
    assert t.stats()["rebuilds"] == 1
    dst = np.empty(SLOT, np.uint8)
    for i, hit in enumerate(hits):
        assert t.read(hit, dst) and np.array_equal(dst, block(i))
    t.close()


def test_torn_write_is_a_counted_miss(path: Path) -> None:
    t = tier(path)
    slot, gen = t.reserve(name(1))
    t.slots[slot][: SLOT // 2] = block(1)[: SLOT // 2]  # torn: half the bytes, then committed
    t.commit(slot, gen, checksum(name(1), block(1)))
    (hit,) = t.lookup([name(1)])
    dst = np.empty(SLOT, np.uint8)
    assert not t.read(hit, dst)
    assert t.counts["checksum_failures"] == 1 and t.counts["hits"] == 0
    assert t.lookup([name(1)]) == []  # the bad slot was dropped
    t.verify()
    t.close()


def test_corrupted_slot_and_wrong_name_are_counted_misses(path: Path) -> None:
    t = tier(path)
    t.store(name(1), block(1))
    t.store(name(2), block(2))
    hit1, hit2 = t.lookup([name(1), name(2)])
    t.slots[hit1.slot][100] ^= 0xFF  # one bit flipped after it was written
    dst = np.empty(SLOT, np.uint8)
    assert not t.read(hit1, dst)
    # the right bytes under another name: the crc covers the name too
    swapped = hit2._replace(name=name(1))
    assert not t.check(swapped, t.slots[hit2.slot].copy())
    assert t.counts["checksum_failures"] == 2
    t.verify()
    t.close()


def test_slot_rewritten_during_a_read_is_stale(path: Path) -> None:
    t = tier(path, 1)
    t.store(name(1), block(1))
    (hit,) = t.lookup([name(1)])
    copy = t.slots[hit.slot].copy()
    other = tier(path, 1)  # another mapping evicts it and writes another block there
    assert other.store(name(2), block(2))
    assert not t.check(hit, copy)
    assert t.counts["stale"] == 1 and t.counts["checksum_failures"] == 0
    other.close()
    t.close()


def test_lru_eviction_keeps_the_recently_used(path: Path) -> None:
    t = tier(path, 4)
    for i in range(4):
        assert t.store(name(i), block(i))
    assert len(t.lookup([name(0)])) == 1  # 0 is now the most recently used: 1 is the oldest
    assert t.store(name(4), block(4))
    assert t.lookup([name(1)]) == []
    assert [len(t.lookup([name(i)])) for i in (0, 2, 3, 4)] == [1, 1, 1, 1]
    assert t.store(name(5), block(5))  # 0 is the oldest again after 2, 3, 4 were looked up
    assert t.lookup([name(0)]) == []
    assert not t.store(name(5), block(5))  # stored already: skipped
    assert t.stats()["evictions"] == 2 and t.counts["skipped"] == 1
    t.verify()
    t.close()


def test_restart_maps_the_same_tier(path: Path) -> None:
    p = _run(_store_and_exit, str(path), [10, 11, 12])
    p.join(60)
    assert p.exitcode == 0
    t = tier(path, 64)  # asks for more: the existing tier keeps its size
    assert t.nslots == 8
    hits = t.lookup([name(10), name(11), name(12)])
    dst = np.empty(SLOT, np.uint8)
    assert len(hits) == 3
    for i, hit in zip((10, 11, 12), hits, strict=True):
        assert t.read(hit, dst) and np.array_equal(dst, block(i))
    t.close()


def test_too_small_and_other_geometry_are_refused(path: Path) -> None:
    with pytest.raises(TierError, match="holds no KV block"):
        HostTier.open(path, slot_bytes=SLOT, capacity_bytes=SLOT - 1)
    tier(path).close()
    with pytest.raises(TierError, match="byte blocks"):
        HostTier.open(path, slot_bytes=2 * SLOT, capacity_bytes=8 * SLOT)


def test_checksums_on_threads_equal_one_by_one() -> None:
    from common.kv.host_tier import PARALLEL_BYTES, checksums

    big = [np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8) for i in range(12)]
    names = [name(i) for i in range(12)]
    assert PARALLEL_BYTES < 12 << 20  # the threads' path
    assert checksums(names, big, 1 << 20) == [
        checksum(n, b) for n, b in zip(names, big, strict=True)
    ]
