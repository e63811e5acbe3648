"""Block allocator: which KV block belongs to whom, and which cached KV it still names. Pure
bookkeeping, no I/O, no clock.

Every block is in exactly one state:

    FREE ----allocate----> OWNED --lease--> LEASED --release / release_holder / free--+
     ^  ^                    |                                                        |
     |  |                    +--free------------------------------------------------+|
     |  +--evict (allocate)--+ CACHED <--last holder gone, block named--------------+|
     +---------------------------------last holder gone, block unnamed---------------+

OWNED blocks belong to requests this daemon is computing; LEASED blocks still hold a request's KV
for a peer (a link) that has not copied them yet. A lease ends when the peer releases it, when the
peer dies (`release_holder`), or when the caller finds it past its deadline (`expired`) and
releases it. Deadlines are plain floats chosen by the caller; the allocator never reads a clock.
A RESERVED block (`reserve`) has left the pool for good: the daemon's own, outside every count
and every verb.

The prefix cache: a full block whose KV is written may be named by its hash (`publish`;
common/kv/blockhash.py) and then shared by several requests (`allocate(..., reuse=...)`); it is
LEASED while any leased request holds it, OWNED while only others do, and CACHED (free, still
named, evicted least recently freed first only when no FREE block is left) once nobody holds it.
docs/architecture.md ("Block allocator") has the rules.

Each kind of state has its book beside this module: FREE runs in common.kv.free_runs, names
and the CACHED order in common.kv.block_names, the LEASED blocks, their holders and deadlines in
common.kv.leases; this class moves blocks between them.

Counts: `num_free` includes the CACHED blocks (`num_cached` of them), so
free + owned + leased == total always.

Cost: every verb is O(blocks it touches) (O(1) per block, O(log) per run of FREE blocks), never
a pass over the whole pool. FREE blocks are handed out longest free run first
(common.kv.free_runs), so a request's blocks come in as few runs of adjacent ids as the pool
allows, and a pull copies (a NIXL transfer posts) each run as one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from common.errors import AllocatorError, OutOfBlocks
from common.kv.block_names import BlockNames
from common.kv.free_runs import FreeRuns
from common.kv.leases import Entry, Lease, LeaseBook


class BlockState(enum.Enum):
    FREE = "free"
    CACHED = "cached"  # free, but still names cached KV (evicted LRU when FREE runs out)
    OWNED = "owned"
    LEASED = "leased"
    RESERVED = "reserved"  # out of the pool for good, the daemon's own (`reserve`)


@dataclass
class _Request:
    blocks: list[int] = field(default_factory=list)
    lease: Lease | None = None
    lease_seq: int = -1  # matches the heap entry of the current lease; stale entries differ


class BlockAllocator:
    """Fixed pool of `num_blocks` KV blocks; see the module docstring for the state machine."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise AllocatorError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self._ids = num_blocks  # block ids are 0 .. num_blocks-1, reserved or not
        self._free = FreeRuns(num_blocks)
        self._names = BlockNames(num_blocks)  # the named blocks and the CACHED ones' LRU order
        self._users: list[set[str]] = [set() for _ in range(num_blocks)]
        self._requests: dict[str, _Request] = {}
        self._leases = LeaseBook(num_blocks, self._live)  # LEASED blocks, holders, deadlines
        self._reserved: set[int] = set()

    # -- counters ---------------------------------------------------------------------------

    @property
    def total(self) -> int:
        """Blocks requests may hold: the pool less the reserved ones."""
        return self._ids - len(self._reserved)

    @property
    def num_ids(self) -> int:
        """Block ids run 0 .. num_ids-1: the pool's size, reserved blocks included."""
        return self._ids

    @property
    def num_free(self) -> int:
        """FREE and CACHED blocks: what an allocation may take."""
        return len(self._free) + self._names.num_parked

    @property
    def num_cached(self) -> int:
        """Free blocks that still name cached KV."""
        return self._names.num_parked

    @property
    def num_named(self) -> int:
        """Blocks named by a hash, held or CACHED."""
        return len(self._names)

    @property
    def evictions(self) -> int:
        """CACHED blocks an allocation took (and so unnamed) since start."""
        return self._names.evictions

    @property
    def num_leased(self) -> int:
        return self._leases.num_leased

    @property
    def num_owned(self) -> int:
        return self.total - self.num_free - self._leases.num_leased

    # -- allocate / free --------------------------------------------------------------------

    def reserve(self) -> int:
        """Take one FREE block out of the pool for good, for the daemon's own use (the
        producer's first-token mailbox): it leaves `total`, so the counters and allocations
        describe only the blocks requests may hold. OutOfBlocks if no block is FREE."""
        if not len(self._free):
            raise OutOfBlocks(1, 0, self.total)
        (block,) = self._free.take(1)
        self._reserved.add(block)
        return block

    def can_allocate(self, n: int, reuse: Sequence[int] = ()) -> bool:
        """True if `allocate(_, n, reuse=reuse)` would succeed now."""
        _check_count(n)
        return n <= self.num_free - self._names.count_parked(reuse)

    def allocate(self, request_id: str, n: int, *, reuse: Sequence[int] = ()) -> list[int]:
        """Give `request_id` the named blocks `reuse` (shared with their other holders; from
        `lookup`) and then n more blocks, FREE ones first, then CACHED ones least recently freed
        first (evicting their names); return them in that order (`reuse` first; the n new ones
        in ascending ids when some were CACHED). All are OWNED from now on.

        A request may allocate again later; its blocks_of() grows in allocation order. n == 0
        and no reuse registers the request with no blocks. Raises OutOfBlocks (and changes
        nothing) when fewer than n blocks are free besides `reuse`, AllocatorError when the
        request is leased or a reused block is unnamed or already its own.
        """
        _check_count(n)
        req = self._requests.get(request_id)
        if req is not None and req.lease is not None:
            raise AllocatorError(
                f"request {request_id!r} is leased to {req.lease.holder!r}; "
                "a leased request cannot grow — release or free it first"
            )
        parked = self._check_reuse(request_id, reuse)
        if n > self.num_free - parked:  # can_allocate's test, counting `reuse` only once
            raise OutOfBlocks(n, self.num_free, self.total)
        if req is None:
            if not isinstance(request_id, str) or not request_id:
                raise AllocatorError(f"request id must be a non-empty str, got {request_id!r}")
            req = self._requests[request_id] = _Request()
        if parked:
            self._names.unpark_all(reuse)
        take = min(n, len(self._free))
        new = self._free.take(take)
        if take < n:
            # least recently freed first (a request's blocks go back to the cache together,
            # deepest first), all in ascending ids with the FREE ones: a FREE block next to an
            # evicted one joins its run (block_runs.py with the cache: 11.6 runs a handoff → 8.1)
            new += (self._names.evict() for _ in range(n - take))
            new.sort()
        blocks = [*reuse, *new]
        users = self._users
        for block in blocks:
            users[block].add(request_id)
        req.blocks.extend(blocks)
        return blocks

    def free(self, request_id: str) -> int:
        """Let go of every block of `request_id`, OWNED or LEASED; return how many; forget it.
        A block another request still holds stays theirs; a named one becomes CACHED."""
        req = self._pop_request(request_id)
        if req.lease is not None:
            self._end_lease(request_id, req)
        unnamed = []
        holders, name_of, park = self._users, self._names.name_of, self._names.park  # per block
        for block in reversed(req.blocks):  # a chain's deepest blocks are evicted first
            users = holders[block]
            users.discard(request_id)
            if users:
                continue
            if name_of(block) is None:
                unnamed.append(block)
            else:
                park(block)
        self._free.put(sorted(unnamed))
        return len(req.blocks)

    # -- names (the prefix cache) -------------------------------------------------------------

    def publish(self, request_id: str, names: Sequence[bytes]) -> int:
        """Name the request's first len(names) blocks, whose KV is written, `names[i]` each;
        return how many got a new name. A block already named keeps its name (it must be the
        same); a name already on another block stays there and this block stays unnamed (two
        requests computed the same prefix at once: one copy is kept)."""
        req = self._get(request_id)
        if len(names) > len(req.blocks):
            raise AllocatorError(
                f"request {request_id!r} has {len(req.blocks)} blocks, cannot name {len(names)}"
            )
        named = 0
        name_of, give = self._names.name_of, self._names.name  # bound once: ~100 blocks a prompt
        for block, name in zip(req.blocks, names, strict=False):
            if (old := name_of(block)) is not None:
                if old != name:
                    raise AllocatorError(f"block {block} is already named otherwise")
                continue
            named += give(block, name)
        return named

    def lookup(self, names: Iterable[bytes]) -> list[int]:
        """The blocks named names[0], names[1], ... up to the first name not cached (the
        longest cached prefix of a chain). Changes nothing."""
        return self._names.lookup(names)

    def block_named(self, name: bytes) -> int | None:
        """The block holding the KV named `name`, or None."""
        return self._names.block_named(name)

    def name_of(self, block_id: int) -> bytes | None:
        """The name of a block (None: unnamed)."""
        self.state_of(block_id)  # range check
        return self._names.name_of(block_id)

    # -- lease / release --------------------------------------------------------------------

    def lease(self, request_id: str, holder: str, deadline: float | None = None) -> None:
        """OWNED → LEASED: `holder` (a link id) may read the request's blocks until released.

        `deadline` is on the caller's clock; `expired(now)` reports the lease once now >= deadline.
        """
        req = self._get(request_id)
        if req.lease is not None:
            raise AllocatorError(
                f"request {request_id!r} is already leased to {req.lease.holder!r}; "
                "release it before leasing again"
            )
        req.lease = Lease(holder, deadline)  # AllocatorError for a bad holder or deadline
        req.lease_seq = self._leases.add(request_id, req.blocks, req.lease)

    def unlease(self, request_id: str) -> None:
        """LEASED → OWNED: the holder refused the request (NO_CAPACITY) and reads none of its
        blocks; they may be leased to another holder."""
        req = self._get(request_id)
        if req.lease is None:
            raise AllocatorError(f"request {request_id!r} is not leased")
        self._end_lease(request_id, req)

    def release(self, request_id: str) -> int:
        """LEASED → FREE: the holder is done with the request's blocks; return how many freed."""
        req = self._get(request_id)
        if req.lease is None:
            raise AllocatorError(
                f"request {request_id!r} is not leased; use free() for an owned request"
            )
        return self.free(request_id)

    def release_holder(self, holder: str) -> list[str]:
        """Free every lease `holder` holds (its peer is gone); return their request ids.

        An unknown holder (or one with no leases left) frees nothing and returns [].
        """
        request_ids = self._leases.of_holder(holder)
        for request_id in request_ids:
            self.free(request_id)
        return request_ids

    def expired(self, now: float) -> list[str]:
        """Ids of leases whose deadline is <= now, earliest first. Changes no block state.

        The caller decides what to do (usually `release` each). Cost: O(expired + stale entries
        popped) — only the part of the deadline heap that is already due is visited.
        """
        return self._leases.due(now)

    # -- queries ----------------------------------------------------------------------------

    def blocks_of(self, request_id: str) -> list[int]:
        """The request's blocks in allocation order (a copy)."""
        return list(self._get(request_id).blocks)

    def lease_of(self, request_id: str) -> Lease | None:
        """The request's lease, or None while it is OWNED."""
        return self._get(request_id).lease

    def state_of(self, block_id: int) -> BlockState:
        """State of one block; AllocatorError for an id outside the pool [0, num_blocks)."""
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise AllocatorError(f"block id must be an int, got {block_id!r}")
        if not 0 <= block_id < self._ids:
            raise AllocatorError(f"block id {block_id} out of range [0, {self._ids})")
        if block_id in self._reserved:
            return BlockState.RESERVED
        if self._leases.is_leased(block_id):
            return BlockState.LEASED
        if self._users[block_id]:
            return BlockState.OWNED
        return BlockState.CACHED if self._names.is_parked(block_id) else BlockState.FREE

    def owner_of(self, block_id: int) -> str | None:
        """A request holding the block (the lowest id when several share it), or None when it is
        FREE or CACHED."""
        self.state_of(block_id)  # range check
        users = self._users[block_id]
        return min(users) if users else None

    def holders_of(self, block_id: int) -> list[str]:
        """Every request holding the block, sorted."""
        self.state_of(block_id)  # range check
        return sorted(self._users[block_id])

    def lease_holders(self, block_id: int) -> set[str]:
        """The peers (lease holders) that may read the block now."""
        self.state_of(block_id)  # range check
        leases = (self._requests[r].lease for r in self._users[block_id])
        return {lease.holder for lease in leases if lease is not None}

    def requests(self) -> list[str]:
        """Ids of all requests holding blocks (or registered with none), OWNED or LEASED."""
        return list(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(total={self.total}, free={self.num_free}, "
            f"cached={self.num_cached}, owned={self.num_owned}, leased={self.num_leased})"
        )

    # -- internals --------------------------------------------------------------------------

    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise AllocatorError(
                f"unknown request {request_id!r}: never allocated, or already freed/released"
            ) from None

    def _pop_request(self, request_id: str) -> _Request:
        req = self._get(request_id)
        del self._requests[request_id]
        return req

    def _check_reuse(self, request_id: str, reuse: Sequence[int]) -> int:
        """AllocatorError unless `request_id` may reuse every block of `reuse`: each a block id,
        named, not already its own, none twice. Returns how many of them are CACHED (parked),
        i.e. would leave the free count.

        On every prefix hit's way to its forward (~100 blocks for a long shared prefix), so one
        pass with the lookups bound locally; state_of is only called for what the plain-int
        range test refuses, to raise its error (or pass an int subclass, as it always did)."""
        total, name_of, users = self._ids, self._names.name_of, self._users
        for block in reuse:
            if not (type(block) is int and 0 <= block < total):
                self.state_of(block)  # range check
            if name_of(block) is None:
                raise AllocatorError(f"block {block} is not named: only cached KV can be reused")
            if request_id in users[block]:
                raise AllocatorError(f"block {block} is already held by {request_id!r}")
        if len(set(reuse)) != len(reuse):
            raise AllocatorError(f"reused blocks repeat: {list(reuse)}")
        return self._names.count_parked(reuse)

    def _end_lease(self, request_id: str, req: _Request) -> None:
        assert req.lease is not None
        lease, req.lease, req.lease_seq = req.lease, None, -1  # its heap entry is now stale
        self._leases.end(request_id, req.blocks, lease)

    def _live(self, entry: Entry) -> bool:
        req = self._requests.get(entry[2])
        return req is not None and req.lease_seq == entry[1]


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise AllocatorError(f"block count must be a non-negative int, got {n!r}")
