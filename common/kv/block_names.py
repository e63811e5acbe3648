"""The prefix cache's index for a BlockAllocator: which block holds the KV named by which hash,
and the CACHED blocks (named, held by nobody) in eviction order. Pure, no I/O.

Split out of common/kv/allocator.py, which owns the block states and decides when a block is named,
parked (its last holder let go) or taken back; this class only keeps the two maps consistent:
a name names at most one block, a block carries at most one name, and a parked block is named.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from functools import partial
from itertools import takewhile
from operator import is_not

_is_block = partial(is_not, None)  # x -> None is not x: a block id, not a miss


class BlockNames:
    def __init__(self, num_blocks: int) -> None:
        self._name: list[bytes | None] = [None] * num_blocks
        self._by_name: dict[bytes, int] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()  # CACHED, evicted from the front
        self.evictions = 0

    def __len__(self) -> int:
        """Named blocks, held or parked."""
        return len(self._by_name)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def name_of(self, block: int) -> bytes | None:
        return self._name[block]

    def block_named(self, name: bytes) -> int | None:
        return self._by_name.get(name)

    def lookup(self, names: Iterable[bytes]) -> list[int]:
        """Blocks named names[0], names[1], ... up to the first name not known."""
        # the same loop in C (a long hit is ~100 names): stop at the first name get() misses
        return list(takewhile(_is_block, map(self._by_name.get, names)))

    def name(self, block: int, name: bytes) -> bool:
        """Give an unnamed block `name`, unless another block has it: True if named."""
        if name in self._by_name:
            return False
        self._name[block] = name
        self._by_name[name] = block
        return True

    def unname(self, block: int) -> None:
        """Forget a block's name (its KV is about to change); nothing if it has none."""
        name = self._name[block]
        if name is not None:
            del self._by_name[name]
            self._name[block] = None
            self._parked.pop(block, None)

    def is_parked(self, block: int) -> bool:
        return block in self._parked

    def count_parked(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` are parked (a block listed twice counts twice); C-level, as it
        runs over every prefix hit."""
        return sum(map(self._parked.__contains__, blocks))

    def park(self, block: int) -> None:
        """A named block nobody holds any more: last in the eviction order."""
        self._parked[block] = None

    def unpark(self, block: int) -> None:
        """A parked block is held again (reused), or nothing if it was not parked."""
        self._parked.pop(block, None)

    def unpark_all(self, blocks: Iterable[int]) -> None:
        """`unpark` each of `blocks`."""
        pop = self._parked.pop
        for block in blocks:
            pop(block, None)

    def evict(self) -> int:
        """The least recently parked block, its name forgotten."""
        block, _ = self._parked.popitem(last=False)
        name = self._name[block]
        assert name is not None
        del self._by_name[name]
        self._name[block] = None
        self.evictions += 1
        return block
