"""What a prefill request waits for before its forward: its KV blocks and an event slot.

Both are waited for within the handoff deadline; every change of capacity (blocks freed, a slot
free again) wakes every waiter, which then looks again. NO_CAPACITY when the deadline passes,
BAD_REQUEST for a prompt the whole pool cannot hold. A prompt's blocks start with the cached
blocks of its prefix (common.kv.prefix_cache), looked up again at every try; CACHED blocks count
as free, so the cache never causes a NO_CAPACITY.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from common.errors import OutOfBlocks
from common.kv.allocator import BlockAllocator
from common.kv.prefix_cache import PrefixCache
from common.model.paged import blocks_for
from common.protocol import ErrorCode
from common.transfer import Producer
from prefill_server.request import RequestFailed


class Capacity:
    """Blocks and event slots: allocated here, freed elsewhere, each freeing announced by
    `changed()`."""

    def __init__(
        self,
        allocator: BlockAllocator,
        producer: Producer,
        block_size: int,
        cache: PrefixCache | None = None,
    ) -> None:
        self.allocator = allocator
        self.producer = producer
        self.block_size = block_size
        self.cache = cache
        self._freed = asyncio.Event()

    def changed(self) -> None:
        """Wake every request waiting for blocks or an event slot."""
        self._freed.set()
        self._freed = asyncio.Event()

    async def blocks(
        self,
        request_id: str,
        num_tokens: int,
        timeout_s: float,
        names: list[bytes] | None = None,
        *,
        lookup: bool = True,
    ) -> tuple[list[int], int]:
        """The blocks of a `num_tokens` prompt, allocated to `request_id` (OWNED), and how many
        of them, from the start, are cached blocks of its prefix (named `names`) it shares.
        `lookup` False: the prompt takes no cached block (nor counts in the hit rate's base),
        all its blocks are new (a prompt whose every position's logits are wanted)."""
        alloc = self.allocator
        cache = self.cache
        need = blocks_for(num_tokens, self.block_size)
        if need > alloc.total:
            raise RequestFailed(
                ErrorCode.BAD_REQUEST,
                f"prompt needs {need} blocks, the pool has {alloc.total} (raise --num-blocks)",
            )
        deadline = time.monotonic() + timeout_s
        while True:
            hit = cache.hit(names, num_tokens) if cache is not None and names and lookup else []
            try:  # allocate checks what can_allocate would: asking both walks `hit` twice
                blocks = alloc.allocate(request_id, need - len(hit), reuse=hit)
                break
            except OutOfBlocks:
                pass
            if not await self._wait(deadline):
                raise RequestFailed(
                    ErrorCode.NO_CAPACITY,
                    f"no {need} free KV blocks within {timeout_s}s "
                    f"({alloc.num_free} free of {alloc.total})",
                )
        if cache is not None and lookup:
            cache.counted(num_tokens, len(hit))
        return blocks, len(hit)

    async def slot(self, timeout_s: float) -> int:
        """An event slot to record after the request's writes (-1: no ring, the CPU case)."""
        deadline = time.monotonic() + timeout_s
        while (slot := self.producer.acquire_slot()) is None:
            if not await self._wait(deadline):
                raise RequestFailed(
                    ErrorCode.NO_CAPACITY,
                    f"all {self.producer.event_slots} handoff event slots busy",
                )
        return slot

    async def _wait(self, deadline: float) -> bool:
        """Wait until capacity changes or `deadline`; False once the deadline has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(left):
                await self._freed.wait()
        return True


__all__ = ["Capacity"]
