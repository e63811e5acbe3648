"""The lease deadlines of a BlockAllocator: a heap with lazy deletion. Pure, no clock.

Split out of common/allocator.py, whose state machine only asks it two things: remember a lease's
deadline (`push`, which returns the entry's sequence number) and list the live entries due by a
time (`due`). An entry is live while its request still holds the lease of that sequence number;
the allocator answers that through the `live` callable, so a freed lease costs nothing here until
the heap is compacted.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

Entry = tuple[float, int, str]  # (deadline, lease sequence number, request id)


class LeaseDeadlines:
    def __init__(self, live: Callable[[Entry], bool]) -> None:
        self._heap: list[Entry] = []  # stale entries skipped, compacted when they dominate
        self._seq = itertools.count()
        self._live = live
        self.count = 0  # live leases with a deadline, to size the heap's garbage

    def next_seq(self) -> int:
        return next(self._seq)

    def push(self, deadline: float, seq: int, request_id: str) -> None:
        self.count += 1
        heapq.heappush(self._heap, (deadline, seq, request_id))

    def ended(self) -> None:
        """A lease with a deadline ended; its entry is now stale."""
        self.count -= 1
        # Rebuild when stale entries outnumber the live ones so the heap stays O(live leases).
        # Amortized O(1) per lease.
        heap = self._heap
        if len(heap) > 64 and len(heap) > 2 * self.count:
            self._heap = [e for e in heap if self._live(e)]
            heapq.heapify(self._heap)

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
        return len(self._heap)
