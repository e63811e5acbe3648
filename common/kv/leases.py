"""The lease book of a BlockAllocator: which requests each holder (a link) leases, and their
deadlines in a heap with lazy deletion. Pure, no clock.

Split out of common/kv/allocator.py, whose state machine asks it to record a lease (`add`, which
returns the lease's sequence number), forget one (`end`), list a holder's requests (`of_holder`)
and the leases due by a time (`due`). A heap entry is live while its request still holds the lease
of that sequence number; the allocator answers that through the `live` callable, so an ended lease
costs nothing here until the heap is compacted.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

Entry = tuple[float, int, str]  # (deadline, lease sequence number, request id)


class LeaseBook:
    def __init__(self, live: Callable[[Entry], bool]) -> None:
        self._holders: dict[str, set[str]] = {}
        self._heap: list[Entry] = []  # stale entries skipped, compacted when they dominate
        self._seq = itertools.count()
        self._live = live
        self._count = 0  # live leases with a deadline, to size the heap's garbage

    def add(self, request_id: str, holder: str, deadline: float | None) -> int:
        """Record a lease; its sequence number."""
        seq = next(self._seq)
        self._holders.setdefault(holder, set()).add(request_id)
        if deadline is not None:
            self._count += 1
            heapq.heappush(self._heap, (deadline, seq, request_id))
        return seq

    def end(self, request_id: str, holder: str, had_deadline: bool) -> None:
        """Forget a lease (its request no longer answers `live` for its entry)."""
        requests = self._holders[holder]
        requests.discard(request_id)
        if not requests:
            del self._holders[holder]
        if not had_deadline:
            return
        self._count -= 1
        # Rebuild when stale entries outnumber the live ones so the heap stays O(live leases).
        # Amortized O(1) per lease.
        if len(self._heap) > 64 and len(self._heap) > 2 * self._count:
            self._heap = [e for e in self._heap if self._live(e)]
            heapq.heapify(self._heap)

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
