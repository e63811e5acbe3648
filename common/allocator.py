"""Block allocator: which KV block belongs to whom. Pure bookkeeping, no I/O, no clock.

Every block is in exactly one state:

    FREE --allocate--> OWNED --lease--> LEASED --release / release_holder--> FREE
                         |                 |
                         +------free-------+--------------------------------> FREE

OWNED blocks belong to a request this daemon is computing; LEASED blocks still hold a request's KV
for a peer (a link) that has not copied them yet. A lease ends when the peer releases it, when the
peer dies (`release_holder`), or when the caller finds it past its deadline (`expired`) and
releases it. Deadlines are plain floats chosen by the caller; the allocator never reads a clock.

Cost: every verb is O(blocks it touches) (O(1) per block), never a pass over the whole pool.
Free blocks are handed out lowest id first and reused last-freed first, so a fresh pool gives a
request adjacent blocks and a pull can copy them as one run.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from dataclasses import dataclass, field

from common.errors import AllocatorError, OutOfBlocks


class BlockState(enum.Enum):
    FREE = "free"
    OWNED = "owned"
    LEASED = "leased"


@dataclass(frozen=True)
class Lease:
    """Who holds a leased request's blocks, and until when (caller's clock; None = no deadline)."""

    holder: str
    deadline: float | None


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
        self._total = num_blocks
        # A stack whose top is the lowest id: allocate pops ascending ids.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owner: list[str | None] = [None] * num_blocks
        self._requests: dict[str, _Request] = {}
        self._holders: dict[str, set[str]] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # heap, stale entries skipped
        self._seq = itertools.count()
        self._num_leased = 0
        self._num_deadlines = 0  # live leases with a deadline, to size the heap's garbage

    # -- counters ---------------------------------------------------------------------------

    @property
    def total(self) -> int:
        return self._total

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_leased(self) -> int:
        return self._num_leased

    @property
    def num_owned(self) -> int:
        return self._total - len(self._free) - self._num_leased

    # -- allocate / free --------------------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        """True if `allocate(_, n)` would succeed now."""
        _check_count(n)
        return n <= len(self._free)

    def allocate(self, request_id: str, n: int) -> list[int]:
        """Give `request_id` n more FREE blocks (OWNED from now on) and return their ids.

        A request may allocate again later; its blocks_of() grows in allocation order. n == 0
        registers the request with no blocks. Raises OutOfBlocks (and changes nothing) when fewer
        than n blocks are free, AllocatorError when the request is leased.
        """
        _check_count(n)
        req = self._requests.get(request_id)
        if req is not None and req.lease is not None:
            raise AllocatorError(
                f"request {request_id!r} is leased to {req.lease.holder!r}; "
                "a leased request cannot grow — release or free it first"
            )
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free), self._total)
        if req is None:
            if not isinstance(request_id, str) or not request_id:
                raise AllocatorError(f"request id must be a non-empty str, got {request_id!r}")
            req = self._requests[request_id] = _Request()
        blocks = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for block in blocks:
            self._owner[block] = request_id
        req.blocks.extend(blocks)
        return blocks

    def free(self, request_id: str) -> int:
        """Free every block of `request_id`, OWNED or LEASED; return how many; forget it."""
        req = self._pop_request(request_id)
        if req.lease is not None:
            self._end_lease(request_id, req)
        self._give_back(req.blocks)
        return len(req.blocks)

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
        if not isinstance(holder, str) or not holder:
            raise AllocatorError(f"lease holder must be a non-empty str, got {holder!r}")
        if deadline is not None and (
            isinstance(deadline, bool)
            or not isinstance(deadline, int | float)
            or math.isnan(deadline)
        ):
            raise AllocatorError(f"lease deadline must be a number or None, got {deadline!r}")
        req.lease = Lease(holder, deadline)
        req.lease_seq = next(self._seq)
        self._holders.setdefault(holder, set()).add(request_id)
        self._num_leased += len(req.blocks)
        if deadline is not None:
            self._num_deadlines += 1
            heapq.heappush(self._deadlines, (deadline, req.lease_seq, request_id))

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
        request_ids = sorted(self._holders.get(holder, ()))
        for request_id in request_ids:
            self.free(request_id)
        return request_ids

    def expired(self, now: float) -> list[str]:
        """Ids of leases whose deadline is <= now, earliest first. Changes no block state.

        The caller decides what to do (usually `release` each). Cost: O(expired + stale entries
        popped) — only the part of the deadline heap that is already due is visited.
        """
        heap = self._deadlines
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        due: list[tuple[float, int, str]] = []
        stack = [0] if heap else []
        while stack:  # walk the heap tree down to the entries past now; children >= parent
            i = stack.pop()
            entry = heap[i]
            if entry[0] > now:
                continue
            if self._live(entry):
                due.append(entry)
            stack.extend(c for c in (2 * i + 1, 2 * i + 2) if c < len(heap))
        due.sort()
        return [request_id for _, _, request_id in due]

    # -- queries ----------------------------------------------------------------------------

    def blocks_of(self, request_id: str) -> list[int]:
        """The request's blocks in allocation order (a copy)."""
        return list(self._get(request_id).blocks)

    def lease_of(self, request_id: str) -> Lease | None:
        """The request's lease, or None while it is OWNED."""
        return self._get(request_id).lease

    def state_of(self, block_id: int) -> BlockState:
        """State of one block; AllocatorError for an id outside [0, total)."""
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise AllocatorError(f"block id must be an int, got {block_id!r}")
        if not 0 <= block_id < self._total:
            raise AllocatorError(f"block id {block_id} out of range [0, {self._total})")
        owner = self._owner[block_id]
        if owner is None:
            return BlockState.FREE
        return BlockState.OWNED if self._requests[owner].lease is None else BlockState.LEASED

    def owner_of(self, block_id: int) -> str | None:
        """Request id holding the block, or None when it is FREE."""
        self.state_of(block_id)  # range check
        return self._owner[block_id]

    def requests(self) -> list[str]:
        """Ids of all requests holding blocks (or registered with none), OWNED or LEASED."""
        return list(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(total={self._total}, free={self.num_free}, "
            f"owned={self.num_owned}, leased={self.num_leased})"
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

    def _end_lease(self, request_id: str, req: _Request) -> None:
        assert req.lease is not None
        holder_set = self._holders[req.lease.holder]
        holder_set.discard(request_id)
        if not holder_set:
            del self._holders[req.lease.holder]
        self._num_leased -= len(req.blocks)
        if req.lease.deadline is not None:
            self._num_deadlines -= 1
        req.lease = None
        req.lease_seq = -1  # its heap entry, if any, is now stale
        self._maybe_compact()

    def _give_back(self, blocks: list[int]) -> None:
        for block in blocks:
            self._owner[block] = None
        self._free.extend(reversed(blocks))  # next allocate gets them back in the same order

    def _live(self, entry: tuple[float, int, str]) -> bool:
        req = self._requests.get(entry[2])
        return req is not None and req.lease_seq == entry[1]

    def _maybe_compact(self) -> None:
        # Stale heap entries are dropped lazily; rebuild when they outnumber the live ones so the
        # heap stays O(live leases). Amortized O(1) per lease.
        heap = self._deadlines
        if len(heap) > 64 and len(heap) > 2 * self._num_deadlines:
            self._deadlines = [e for e in heap if self._live(e)]
            heapq.heapify(self._deadlines)


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise AllocatorError(f"block count must be a non-negative int, got {n!r}")
