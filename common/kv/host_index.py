"""The host tier's index, inside its shared region: the header, one record per slot, a hash table
from block name to slot, the free list and the LRU list. Pure bookkeeping over a buffer, no I/O,
no lock: every method is called by common/kv/host_tier.py with the region's lock held.

Region layout (little-endian; docs/architecture.md, "Host KV tier"):

    [0, 4096)                     header (_HEAD): magic, version, geometry, list heads, counters
    [4096, 4096 + 64 * nslots)    slot records (_SLOT): name, generation, tick, state, crc, pid,
                                  prev/next (LRU list for READY slots, free list for FREE ones)
    then 4 * table_cap bytes      hash table: slot index, EMPTY or TOMB (open addressing)
    from data_offset (page-aligned) nslots * slot_bytes of block bytes

The slot records are the truth; the hash table and both lists are derived from them and rebuilt
(`rebuild`) whenever a lock holder died mid-update (the header's `dirty` names it). A slot's
state moves FREE → WRITING (reserved by a writer, invisible to readers) → READY (bytes and crc
written) → FREE (evicted or dropped); each write of a state is one aligned 4-byte store, and a
slot leaving READY is marked FREE before anything else of it changes, so a crash at any point
leaves no READY slot whose name, crc and bytes disagree undetectably (the crc covers the name).
A slot's generation grows each time it is reserved: a reader that saw generation g and finds g
again after its copy copied bytes nobody rewrote meanwhile.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import NamedTuple

MAGIC = b"PDKVTIER"
VERSION = 1
HEADER_BYTES = 4096
SLOT_RECORD = 64
PAGE = 4096
EMPTY, TOMB, NONE = -1, -2, -1
FREE, WRITING, READY = 0, 1, 2

# magic, version, nslots, slot_bytes, table_cap, dirty, free_head, lru_head (newest),
# lru_tail (oldest), used, tick, tombs, evictions, stored, rebuilds
_HEAD = struct.Struct("<8sIIQIIiiiIQIQQQ")
_NSLOTS, _DIRTY, _FREE, _LRU_HEAD, _LRU_TAIL, _USED, _TICK, _TOMBS = 12, 28, 32, 36, 40, 44, 48, 56
_EVICTIONS, _STORED, _REBUILDS = 64, 72, 80
_I32, _U32, _U64 = struct.Struct("<i"), struct.Struct("<I"), struct.Struct("<Q")
# name, gen, tick, state, crc, pid, prev, next
_SLOT = struct.Struct("<16sQQIIIii")
_S_GEN, _S_TICK, _S_STATE, _S_CRC, _S_PID, _S_PREV, _S_NEXT = 16, 24, 32, 36, 40, 44, 48


class Hit(NamedTuple):
    """A READY slot as a reader saw it under the lock: what its copy is checked against."""

    slot: int
    gen: int
    crc: int
    name: bytes


def geometry(nslots: int, slot_bytes: int) -> tuple[int, int, int]:
    """(table_cap, data_offset, total bytes) of a region of `nslots` slots."""
    cap = 1 << max(4, (2 * nslots - 1).bit_length())  # >= 2x slots: short probes
    meta_end = HEADER_BYTES + SLOT_RECORD * nslots + 4 * cap
    data = -(-meta_end // PAGE) * PAGE
    return cap, data, data + nslots * slot_bytes


class Index:
    """The region's bookkeeping seen through `buf` (a writable buffer of the whole region)."""

    def __init__(self, buf: memoryview, nslots: int, slot_bytes: int) -> None:
        self.buf = buf
        self.nslots, self.slot_bytes = nslots, slot_bytes
        self.cap, self.data_offset, self.nbytes = geometry(nslots, slot_bytes)
        self._table = HEADER_BYTES + SLOT_RECORD * nslots

    # -- header -------------------------------------------------------------------------------
    def format(self) -> None:
        """A new region: every slot FREE, empty table; the magic written last."""
        b = self.buf
        b[: HEADER_BYTES + SLOT_RECORD * self.nslots + 4 * self.cap] = bytes(
            HEADER_BYTES + SLOT_RECORD * self.nslots + 4 * self.cap
        )
        _HEAD.pack_into(
            b, 0, b"\0" * 8, VERSION, self.nslots, self.slot_bytes, self.cap, 0,
            NONE, NONE, NONE, 0, 0, 0, 0, 0, 0,
        )  # fmt: skip
        self._rebuild_lists()
        b[:8] = MAGIC

    @staticmethod
    def read_geometry(buf: memoryview) -> tuple[bytes, int, int, int]:
        """(magic, version, nslots, slot_bytes) of a region's header."""
        magic, version, nslots, slot_bytes, *_ = _HEAD.unpack_from(buf, 0)
        return magic, version, nslots, slot_bytes

    def _get(self, st: struct.Struct, off: int) -> int:
        return st.unpack_from(self.buf, off)[0]

    def _put(self, st: struct.Struct, off: int, value: int) -> None:
        st.pack_into(self.buf, off, value)

    @property
    def dirty(self) -> int:
        return self._get(_U32, _DIRTY)

    @dirty.setter
    def dirty(self, pid: int) -> None:
        self._put(_U32, _DIRTY, pid)

    def counters(self) -> dict[str, int]:
        return {
            "slots": self.nslots,
            "used": self._get(_U32, _USED),
            "evictions": self._get(_U64, _EVICTIONS),
            "stored": self._get(_U64, _STORED),
            "rebuilds": self._get(_U64, _REBUILDS),
        }

    # -- slot records ---------------------------------------------------------------------------
    def _rec(self, slot: int) -> int:
        return HEADER_BYTES + SLOT_RECORD * slot

    def state(self, slot: int) -> int:
        return self._get(_U32, self._rec(slot) + _S_STATE)

    def gen(self, slot: int) -> int:
        return self._get(_U64, self._rec(slot) + _S_GEN)

    def name(self, slot: int) -> bytes:
        off = self._rec(slot)
        return bytes(self.buf[off : off + 16])

    def pid(self, slot: int) -> int:
        return self._get(_U32, self._rec(slot) + _S_PID)

    def data(self, slot: int) -> tuple[int, int]:
        """The byte range of the slot's block."""
        start = self.data_offset + slot * self.slot_bytes
        return start, start + self.slot_bytes

    def _tick(self) -> int:
        t = self._get(_U64, _TICK) + 1
        self._put(_U64, _TICK, t)
        return t

    # -- hash table -----------------------------------------------------------------------------
    def _bucket(self, name: bytes) -> int:
        return int.from_bytes(name[:8], "little") & (self.cap - 1)

    def _cell(self, i: int) -> int:
        return self._get(_I32, self._table + 4 * i)

    def _set_cell(self, i: int, v: int) -> None:
        self._put(_I32, self._table + 4 * i, v)

    def find(self, name: bytes) -> int:
        """The slot named `name` (WRITING or READY), or NONE."""
        i, mask = self._bucket(name), self.cap - 1
        for _ in range(self.cap):
            v = self._cell(i)
            if v == EMPTY:
                return NONE
            if v >= 0 and self.name(v) == name:
                return v
            i = (i + 1) & mask
        return NONE

    def _insert(self, name: bytes, slot: int) -> None:
        i, mask = self._bucket(name), self.cap - 1
        while self._cell(i) >= 0:
            i = (i + 1) & mask
        if self._cell(i) == TOMB:
            self._put(_U32, _TOMBS, self._get(_U32, _TOMBS) - 1)
        self._set_cell(i, slot)

    def _remove(self, name: bytes, slot: int) -> None:
        i, mask = self._bucket(name), self.cap - 1
        for _ in range(self.cap):
            v = self._cell(i)
            if v == EMPTY:
                return
            if v == slot:
                self._set_cell(i, TOMB)
                tombs = self._get(_U32, _TOMBS) + 1
                self._put(_U32, _TOMBS, tombs)
                if tombs > self.cap // 4:  # long probes: the table again, without tombstones
                    self._rebuild_table()
                return
            i = (i + 1) & mask

    # -- lists (prev/next in the slot records) -------------------------------------------------
    def _link(self, slot: int, field: int, value: int) -> None:
        self._put(_I32, self._rec(slot) + field, value)

    def _lru_push(self, slot: int) -> None:
        """`slot` becomes the most recently used."""
        head = self._get(_I32, _LRU_HEAD)
        self._link(slot, _S_PREV, NONE)
        self._link(slot, _S_NEXT, head)
        if head != NONE:
            self._link(head, _S_PREV, slot)
        else:
            self._put(_I32, _LRU_TAIL, slot)
        self._put(_I32, _LRU_HEAD, slot)

    def _lru_unlink(self, slot: int) -> None:
        rec = self._rec(slot)
        prev, nxt = self._get(_I32, rec + _S_PREV), self._get(_I32, rec + _S_NEXT)
        if prev != NONE:
            self._link(prev, _S_NEXT, nxt)
        else:
            self._put(_I32, _LRU_HEAD, nxt)
        if nxt != NONE:
            self._link(nxt, _S_PREV, prev)
        else:
            self._put(_I32, _LRU_TAIL, prev)

    def _free_push(self, slot: int) -> None:
        self._link(slot, _S_NEXT, self._get(_I32, _FREE))
        self._put(_I32, _FREE, slot)

    def _free_pop(self) -> int:
        slot = self._get(_I32, _FREE)
        if slot != NONE:
            self._put(_I32, _FREE, self._get(_I32, self._rec(slot) + _S_NEXT))
        return slot

    # -- verbs ----------------------------------------------------------------------------------
    def lookup(self, names: Iterable[bytes]) -> list[Hit]:
        """The READY slots named names[0], names[1], ... up to the first one missing (or still
        being written), each made the most recently used."""
        hits = []
        for name in names:
            slot = self.find(name)
            if slot == NONE or self.state(slot) != READY:
                break
            rec = self._rec(slot)
            _, gen, _, _, crc, _, _, _ = _SLOT.unpack_from(self.buf, rec)
            self._lru_unlink(slot)
            self._lru_push(slot)
            self._put(_U64, rec + _S_TICK, self._tick())
            hits.append(Hit(slot, gen, crc, name))
        return hits

    def reserve(self, name: bytes, pid: int, alive: Callable[[int], bool]) -> tuple[int, int]:
        """A slot for the block `name`, WRITING by `pid`: (slot, generation); (NONE, 0) when the
        name is already stored or being written, (NONE, -1) when every slot is being written."""
        if (old := self.find(name)) != NONE:
            if self.state(old) == READY or alive(self.pid(old)):
                return NONE, 0
            self.drop(old, self.gen(old))  # its writer was killed mid-write
        slot = self._free_pop()
        if slot == NONE:
            slot = self._evict()
        if slot == NONE and self.reclaim(alive):
            slot = self._free_pop()
        if slot == NONE:
            return NONE, -1
        rec = self._rec(slot)
        gen = self.gen(slot) + 1
        self._put(_U32, rec + _S_PID, pid)
        self.buf[rec : rec + 16] = name
        self._put(_U64, rec + _S_GEN, gen)
        self._put(_U32, rec + _S_STATE, WRITING)  # last: a crash before this leaves it FREE
        self._insert(name, slot)
        return slot, gen

    def _evict(self) -> int:
        """The least recently used READY slot, FREE now and out of the table; NONE if none."""
        slot = self._get(_I32, _LRU_TAIL)
        if slot == NONE:
            return NONE
        self._put(_U32, self._rec(slot) + _S_STATE, FREE)  # first: see the module docstring
        self._lru_unlink(slot)
        self._remove(self.name(slot), slot)
        self._put(_U32, _USED, self._get(_U32, _USED) - 1)
        self._put(_U64, _EVICTIONS, self._get(_U64, _EVICTIONS) + 1)
        return slot

    def commit(self, slot: int, gen: int, crc: int) -> bool:
        """The writer of (slot, gen) wrote its bytes: READY with `crc`, most recently used.
        False (nothing changed) if the slot is no longer that reservation."""
        rec = self._rec(slot)
        if self.gen(slot) != gen or self.state(slot) != WRITING:
            return False
        self._put(_U32, rec + _S_CRC, crc)
        self._put(_U64, rec + _S_TICK, self._tick())
        self._put(_U32, rec + _S_STATE, READY)
        self._lru_push(slot)
        self._put(_U32, _USED, self._get(_U32, _USED) + 1)
        self._put(_U64, _STORED, self._get(_U64, _STORED) + 1)
        return True

    def drop(self, slot: int, gen: int) -> bool:
        """Forget (slot, gen), READY (its checksum failed) or WRITING (its write was given up):
        FREE again. False if the slot has moved on since."""
        state = self.state(slot)
        if self.gen(slot) != gen or state == FREE:
            return False
        self._put(_U32, self._rec(slot) + _S_STATE, FREE)
        if state == READY:
            self._lru_unlink(slot)
            self._put(_U32, _USED, self._get(_U32, _USED) - 1)
        self._remove(self.name(slot), slot)
        self._free_push(slot)
        return True

    def reclaim(self, alive: Callable[[int], bool]) -> int:
        """Free the WRITING slots whose writer is dead (killed mid-write: never readable);
        return how many."""
        dead = [
            s for s in range(self.nslots) if self.state(s) == WRITING and not alive(self.pid(s))
        ]
        for slot in dead:
            self.drop(slot, self.gen(slot))
        return len(dead)

    def rebuild(self, alive: Callable[[int], bool]) -> None:
        """A lock holder died mid-update: the table and lists again from the slot records,
        WRITING slots of dead writers freed."""
        for slot in range(self.nslots):
            if self.state(slot) == WRITING and not alive(self.pid(slot)):
                self._put(_U32, self._rec(slot) + _S_STATE, FREE)
        self._rebuild_lists()
        self._put(_U64, _REBUILDS, self._get(_U64, _REBUILDS) + 1)

    def _rebuild_lists(self) -> None:
        self._put(_I32, _FREE, NONE)
        self._put(_I32, _LRU_HEAD, NONE)
        self._put(_I32, _LRU_TAIL, NONE)
        ready = []
        for slot in reversed(range(self.nslots)):  # the free list hands out low slots first
            state = self.state(slot)
            if state == READY:
                ready.append((self._get(_U64, self._rec(slot) + _S_TICK), slot))
            elif state == FREE:
                self._free_push(slot)
        for _, slot in sorted(ready):  # oldest first: the newest ends at the head
            self._lru_push(slot)
        self._put(_U32, _USED, len(ready))
        self._rebuild_table()

    def _rebuild_table(self) -> None:
        self.buf[self._table : self._table + 4 * self.cap] = b"\xff" * (4 * self.cap)  # EMPTY
        self._put(_U32, _TOMBS, 0)
        for slot in range(self.nslots):
            if self.state(slot) != FREE:
                self._insert(self.name(slot), slot)

    def check(self) -> None:
        """AssertionError unless the derived structures agree with the slot records (tests)."""
        states = [self.state(s) for s in range(self.nslots)]
        free, slot = [], self._get(_I32, _FREE)
        while slot != NONE:
            free.append(slot)
            slot = self._get(_I32, self._rec(slot) + _S_NEXT)
        lru, slot = [], self._get(_I32, _LRU_HEAD)
        while slot != NONE:
            lru.append(slot)
            slot = self._get(_I32, self._rec(slot) + _S_NEXT)
        assert sorted(free) == [s for s, st in enumerate(states) if st == FREE], "free list"
        assert sorted(lru) == [s for s, st in enumerate(states) if st == READY], "LRU list"
        assert self._get(_U32, _USED) == len(lru), "used count"
        for s, st in enumerate(states):
            if st != FREE:
                assert self.find(self.name(s)) == s, f"slot {s} not found by its name"


__all__ = ["FREE", "MAGIC", "NONE", "READY", "VERSION", "WRITING", "Hit", "Index", "geometry"]
