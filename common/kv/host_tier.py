"""The host KV tier: one shared-memory region of fixed-size block slots, mapped by every daemon on
the host that serves the same pool layout, its blocks named by the prefix cache's chained hashes
(common/kv/blockhash.py). Any daemon writes a block once; every daemon finds it.

A file in /dev/shm (`default_path`: named from the runtime dir and the block layout), so it
outlives any one daemon: a restarted daemon maps the same tier. Its index (common/kv/host_index.py)
lives inside it; this module owns the file, the lock, and the read and write protocols:

- **Lock**: `flock(LOCK_EX)` on the region's file descriptor (plus a thread lock, as flock does
  not exclude threads sharing one descriptor). The kernel drops a flock when its holder dies, so a
  SIGKILLed holder never wedges the others; the holder writes its pid into the header's `dirty`
  before it changes anything and clears it after, so the next holder that finds it set rebuilds
  the table and lists from the slot records (Index.rebuild). Held only for index updates
  (microseconds), never during a copy.
- **Write**: reserve a slot (WRITING, in the table but invisible to lookups) under the lock, copy
  the bytes and compute their crc32 (seeded with the block's name) without it, then commit (READY)
  under the lock. A writer killed mid-copy leaves a WRITING slot nobody reads; it is freed once
  its pid is found dead (Index.reclaim).
- **Read**: look the names up under the lock (generation, crc), copy without it, then check the
  copy's crc (name and bytes) and, under the lock, that the generation did not move (the slot was
  not evicted and rewritten meanwhile). Either failing is a miss: counted, logged, never wrong KV;
  a bad crc also drops the slot. Readers never pin slots, so a dead reader leaks nothing.

zlib.crc32 (stdlib, ~5 GB/s on the 2-core CPU VM, against ~10 GB/s for the copy itself) rather
than xxhash (faster, one more wheel for the GPU hosts): docs/benchmarks.md has the numbers.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import threading
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from common.daemon.rundir import pid_alive
from common.errors import PdkvError
from common.kv.host_index import MAGIC, NONE, VERSION, Hit, Index, geometry

log = structlog.get_logger(__name__)


class TierError(PdkvError):
    """The host tier cannot be opened as asked (too small for one block, another layout)."""


def default_path(runtime_dir: Path, layout: dict[str, Any]) -> Path:
    """/dev/shm/pdkv-UID-<runtime dir>-tier-<block layout>: one tier per runtime dir (per host with
    the default one) and per block geometry (num_blocks left out: pools of any size share it)."""
    shape = sorted((k, v) for k, v in layout.items() if k != "num_blocks")
    rd = hashlib.blake2b(str(Path(runtime_dir).resolve()).encode(), digest_size=6).hexdigest()
    lay = hashlib.blake2b(repr(shape).encode(), digest_size=6).hexdigest()
    return Path("/dev/shm") / f"pdkv-{os.getuid()}-{rd}-tier-{lay}"


def checksum(name: bytes, data: Any) -> int:
    """The slot's crc32: its block name, then its bytes."""
    return zlib.crc32(data, zlib.crc32(name))


PARALLEL_BYTES = 8 << 20  # checksums of more bytes than this at once run on several threads
_crc_pool: ThreadPoolExecutor | None = None


def checksums(names: Sequence[bytes], blocks: Sequence[Any], nbytes: int) -> list[int]:
    """`checksum` of each (name, block), `nbytes` each: on several threads when there is much
    (zlib releases the GIL over a large buffer; one thread does ~5 GB/s, an 8B model's restore
    wants ~40), else here."""
    global _crc_pool
    if len(blocks) * nbytes <= PARALLEL_BYTES or len(blocks) < 2:
        return list(map(checksum, names, blocks))
    if _crc_pool is None:
        _crc_pool = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="pdkv-crc")
    return list(_crc_pool.map(checksum, names, blocks))


class HostTier:
    """One process's mapping of the tier. Thread-safe; `close()` unmaps (the file stays)."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, nslots: int, slot_bytes: int) -> None:
        self.path, self._fd, self._mm = path, fd, mm
        self.nslots, self.slot_bytes = nslots, slot_bytes
        self._buf = memoryview(mm)
        self.index = Index(self._buf, nslots, slot_bytes)
        start = self.index.data_offset
        self.slots = np.frombuffer(mm, np.uint8, nslots * slot_bytes, start).reshape(nslots, -1)
        self._thread_lock = threading.Lock()
        self._pid = os.getpid()
        self.counts = dict.fromkeys(
            ("hits", "misses", "checksum_failures", "stale", "stored", "skipped", "full"), 0
        )
        self.bytes_read = self.bytes_written = 0

    @classmethod
    def open(cls, path: Path, *, slot_bytes: int, capacity_bytes: int) -> HostTier:
        """Map the tier at `path`, making it (`capacity_bytes` of slots) if missing or unformatted.
        An existing tier keeps its size; TierError if it holds other-sized slots or if
        `capacity_bytes` cannot hold one block."""
        nslots = capacity_bytes // slot_bytes
        if nslots < 1:
            raise TierError(
                f"--host-cache-gb {capacity_bytes / 2**30:g} holds no KV block "
                f"(one block is {slot_bytes} bytes): raise it, or 0 to turn the tier off"
            )
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                nslots, fresh = cls._shape(fd, nslots, slot_bytes)
                mm = mmap.mmap(fd, geometry(nslots, slot_bytes)[2])
                tier = cls(path, fd, mm, nslots, slot_bytes)
                if fresh:
                    tier.index.format()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        log.info("host_tier_mapped", path=str(path), slots=nslots, fresh=fresh)
        return tier

    @classmethod
    def attach(cls, path: Path) -> HostTier:
        """Map an existing tier at its own geometry (tools, tests)."""
        with open(path, "rb") as fh:
            magic, version, _, slot_bytes = Index.read_geometry(memoryview(fh.read(4096)))
        if magic != MAGIC or version != VERSION:
            raise TierError(f"{path} is not a host tier (version {VERSION})")
        return cls.open(path, slot_bytes=slot_bytes, capacity_bytes=slot_bytes)

    @staticmethod
    def _shape(fd: int, nslots: int, slot_bytes: int) -> tuple[int, bool]:
        """(nslots, needs formatting) of the file under our lock: an existing tier's own."""
        size = os.fstat(fd).st_size
        if size >= 4096:
            head = memoryview(os.pread(fd, 4096, 0))
            magic, version, have_slots, have_bytes = Index.read_geometry(head)
            if magic == MAGIC and version == VERSION:
                if have_bytes != slot_bytes:
                    raise TierError(
                        f"host tier holds {have_bytes}-byte blocks, ours are {slot_bytes}"
                    )
                return have_slots, False
        os.ftruncate(fd, geometry(nslots, slot_bytes)[2])  # a new one, or one whose maker died
        return nslots, True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[Index]:
        """The index, exclusively (threads and processes); rebuilt first if the last holder died
        mid-update."""
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                index = self.index
                if index.dirty:
                    log.warning("host_tier_rebuilt", dead_holder=index.dirty)
                    index.rebuild(pid_alive)
                index.dirty = self._pid
                yield index
                index.dirty = 0
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- read -----------------------------------------------------------------------------------
    def lookup(self, names: Sequence[bytes]) -> list[Hit]:
        """The stored blocks named names[0], names[1], ... up to the first not stored."""
        if not names:
            return []
        with self._locked() as index:
            hits = index.lookup(names)
        self.counts["misses"] += len(names) > len(hits)
        return hits

    def check(self, hit: Hit, copy: Any) -> bool:
        """Whether `copy` (the bytes read from `hit`'s slot, after the read) is that block: its
        crc matches and the slot was not rewritten meanwhile (`check_many`)."""
        return self.check_many([hit], [copy]) == 1

    def check_many(self, hits: Sequence[Hit], copies: Sequence[Any]) -> int:
        """How many leading `copies` (each read from its hit's slot) are their blocks: crc of
        name and bytes as written, generation unmoved (one lock for all). The first that is not
        is counted and logged; a bad crc also drops its slot."""
        crcs = checksums([h.name for h in hits], copies, self.slot_bytes)
        good, bad, moved = 0, None, False
        with self._locked() as index:
            for hit, crc in zip(hits, crcs, strict=True):
                moved = index.gen(hit.slot) != hit.gen
                if moved or crc != hit.crc:
                    bad = hit
                    if not moved:
                        index.drop(hit.slot, hit.gen)
                    break
                good += 1
        self.counts["hits"] += good
        self.bytes_read += good * self.slot_bytes
        if bad is not None and moved:
            self.counts["stale"] += 1
            log.warning("host_tier_slot_reused_during_read", slot=bad.slot)
        elif bad is not None:
            self.counts["checksum_failures"] += 1
            log.error("host_tier_checksum_failed", slot=bad.slot, name=bad.name.hex())
        return good

    def read(self, hit: Hit, dst: np.ndarray) -> bool:
        """Copy `hit`'s block into `dst` (uint8, slot_bytes) and check it (`check`)."""
        np.copyto(dst, self.slots[hit.slot])
        return self.check(hit, dst)

    def read_many(self, hits: Sequence[Hit], dsts: Sequence[np.ndarray]) -> int:
        """Copy each hit's block into its `dsts` entry; how many leading ones are whole."""
        for hit, dst in zip(hits, dsts, strict=False):
            np.copyto(dst, self.slots[hit.slot])
        n = min(len(hits), len(dsts))
        return self.check_many(hits[:n], dsts[:n])

    # -- write ----------------------------------------------------------------------------------
    def reserve(self, name: bytes) -> tuple[int, int]:
        """A slot to write block `name` into, (slot, generation); (NONE, 0) when the block is
        already stored (or being written) or no slot can be had."""
        with self._locked() as index:
            slot, gen = index.reserve(name, self._pid, pid_alive)
        if slot == NONE:
            self.counts["full" if gen < 0 else "skipped"] += 1
        return slot, gen

    def commit(self, slot: int, gen: int, crc: int) -> bool:
        """The reservation's bytes are written, their checksum `crc`: readable from now on."""
        with self._locked() as index:
            ok = index.commit(slot, gen, crc)
        if ok:
            self.counts["stored"] += 1
            self.bytes_written += self.slot_bytes
        return ok

    def abandon(self, slot: int, gen: int) -> None:
        """Give a reservation up unwritten."""
        with self._locked() as index:
            index.drop(slot, gen)

    def store(self, name: bytes, src: Any) -> bool:
        """Write block `name` (`src`: slot_bytes bytes, any buffer) unless already stored."""
        return self.store_many([(name, src)]) == 1

    def store_many(self, blocks: Sequence[tuple[bytes, Any]]) -> int:
        """`store` each (name, bytes), one lock to reserve them all and one to commit; how many
        were new."""
        with self._locked() as index:
            slots = [index.reserve(name, self._pid, pid_alive) for name, _ in blocks]
        done = []
        try:
            names, copies, taken = [], [], []
            for (name, src), (slot, gen) in zip(blocks, slots, strict=True):
                if slot == NONE:
                    self.counts["full" if gen < 0 else "skipped"] += 1
                    continue
                dst = self.slots[slot]
                np.copyto(dst, np.frombuffer(src, np.uint8))
                names.append(name)
                copies.append(dst)
                taken.append((slot, gen))
            crcs = checksums(names, copies, self.slot_bytes)
            done = [(slot, gen, crc) for (slot, gen), crc in zip(taken, crcs, strict=True)]
        finally:
            with self._locked() as index:
                stored = sum(index.commit(*each) for each in done)
                for slot, gen in slots:  # reserved and not written (an error): given up
                    if slot != NONE and all(slot != d[0] for d in done):
                        index.drop(slot, gen)
        self.counts["stored"] += stored
        self.bytes_written += stored * self.slot_bytes
        return stored

    def contains(self, name: bytes) -> bool:
        """Whether block `name` is stored or being written (no LRU touch)."""
        with self._locked() as index:
            return index.find(name) != NONE

    # -- the rest -------------------------------------------------------------------------------
    def reclaim(self) -> int:
        """Free slots whose writer died mid-write; how many."""
        with self._locked() as index:
            return index.reclaim(pid_alive)

    def verify(self) -> None:
        """AssertionError unless the index agrees with the slot records (tests)."""
        with self._locked() as index:
            index.check()

    def stats(self) -> dict[str, int]:
        """This process's counters and the tier's occupancy (STATUS_REPLY's `host_tier`)."""
        with self._locked() as index:
            shared = index.counters()
        return {
            "enabled": 1,
            "capacity_bytes": self.nslots * self.slot_bytes,
            "slot_bytes": self.slot_bytes,
            **shared,
            **self.counts,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
        }

    def close(self) -> None:
        """Unmap and close (idempotent); the region stays for the other daemons."""
        if self._fd < 0:
            return
        self.slots = None  # type: ignore[assignment]
        self.index.buf = None  # type: ignore[assignment]
        self._buf.release()
        try:
            self._mm.close()
        except BufferError:  # a view a caller still holds: the mapping goes with the process
            log.warning("host_tier_view_held_at_close", path=str(self.path))
        os.close(self._fd)
        self._fd = -1


__all__ = ["HostTier", "TierError", "checksum", "checksums", "default_path"]
