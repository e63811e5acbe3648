"""The lease book of a BlockAllocator: the LEASED state's bookkeeping. Pure, no clock.

A lease lets a holder (a link) read a request's blocks until it is released. The book keeps
- how many leased requests hold each block (a block is LEASED while any does), and their count;
- which requests each holder leases (`of_holder`: what a lost peer frees);
- the deadlines, in a heap with lazy deletion (`due`).

The allocator decides when a lease begins (`add`, which returns the lease's sequence number) and
ends (`end`); this class only keeps its counts consistent. A heap entry is live while its request
still holds the lease of that sequence number; the allocator answers that through the `live`
callable, so an ended lease costs nothing here until the heap is compacted.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.errors import AllocatorError

Entry = tuple[float, int, str]  # (deadline, lease sequence number, request id)


@dataclass(frozen=True)
class Lease:
    """Who holds a leased request's blocks, and until when (caller's clock; None = no deadline).
    AllocatorError for an empty holder or a deadline that is not a number."""

    holder: str
    deadline: float | None

    def __post_init__(self) -> None:
        if not isinstance(self.holder, str) or not self.holder:
            raise AllocatorError(f"lease holder must be a non-empty str, got {self.holder!r}")
        d = self.deadline
        if d is not None and (
            isinstance(d, bool) or not isinstance(d, int | float) or math.isnan(d)
        ):
            raise AllocatorError(f"lease deadline must be a number or None, got {d!r}")


class LeaseBook:
    def __init__(self, num_blocks: int, live: Callable[[Entry], bool]) -> None:
        self._refs = [0] * num_blocks  # leased requests holding each block
        self.num_leased = 0  # blocks with refs > 0
        self._holders: dict[str, set[str]] = {}
        self._heap: list[Entry] = []  # stale entries skipped, compacted when they dominate
        self._seq = itertools.count()
        self._live = live
        self._count = 0  # live leases with a deadline, to size the heap's garbage

    def add(self, request_id: str, blocks: Sequence[int], lease: Lease) -> int:
        """Record a lease on the request's blocks; its sequence number."""
        refs = self._refs
        for block in blocks:
            refs[block] += 1
            self.num_leased += refs[block] == 1
        seq = next(self._seq)
        self._holders.setdefault(lease.holder, set()).add(request_id)
        if lease.deadline is not None:
            self._count += 1
            heapq.heappush(self._heap, (lease.deadline, seq, request_id))
        return seq

    def end(self, request_id: str, blocks: Sequence[int], lease: Lease) -> None:
        """Forget a lease (its request no longer answers `live` for its entry)."""
        refs = self._refs
        for block in blocks:
            refs[block] -= 1
            self.num_leased -= refs[block] == 0
        requests = self._holders[lease.holder]
        requests.discard(request_id)
        if not requests:
            del self._holders[lease.holder]
        if lease.deadline is None:
            return
        self._count -= 1
        # Rebuild when stale entries outnumber the live ones so the heap stays O(live leases).
        # Amortized O(1) per lease.
        if len(self._heap) > 64 and len(self._heap) > 2 * self._count:
            self._heap = [e for e in self._heap if self._live(e)]
            heapq.heapify(self._heap)

    def is_leased(self, block: int) -> bool:
        """True while some leased request holds the block."""
        return self._refs[block] > 0

    def of_holder(self, holder: str) -> list[str]:
        """The request ids `holder` leases, sorted."""
        return sorted(self._holders.get(holder, ()))

    def due(self, now: float) -> list[str]:
        """Request ids of live entries with deadline <= now, earliest first. Cost: O(due + stale
        entries popped): only the part of the heap that is already due is visited."""
        heap = self._heap
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        found: list[Entry] = []
        stack = [0] if heap else []
        while stack:  # walk the heap tree down to the entries past now; children >= parent
            i = stack.pop()
            entry = heap[i]
            if entry[0] > now:
                continue
            if self._live(entry):
                found.append(entry)
            stack.extend(c for c in (2 * i + 1, 2 * i + 2) if c < len(heap))
        found.sort()
        return [request_id for _, _, request_id in found]

    def __len__(self) -> int:
        """Heap entries, stale ones included."""
        return len(self._heap)
