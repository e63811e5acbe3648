"""A daemon's prefix cache, as its request path uses it: a prompt's block names, the cached blocks
it may reuse, publishing its blocks once their KV is written, and the counters STATUS reports
(`pdkv status`, the API's /metrics). The blocks' states live in the allocator
(common/kv/allocator.py); this is the policy around it, the same in both daemons:

- only full blocks are named (common/kv/blockhash.py);
- a prompt reuses the longest run of cached blocks from its start, but never the block holding
  its last token: the prefill computes at least that token (its logits give the first token),
  and the decode pulls at least that block (a pull is never empty);
- a request's blocks are published only once their KV is written (the prefill: after its
  forward; the decode: after its pull), so a lookup never hands out a block being written.

docs/operations.md ("Prefix cache") says how it meets pool size and NO_CAPACITY.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from common.kv.allocator import BlockAllocator
from common.kv.blockhash import LazyNames, hash_seed
from common.kv.pool import PoolLayout


class PrefixCache:
    """One per daemon (ModelRuntime.prefix); `enabled` False (--no-prefix-cache) makes every verb
    a no-op."""

    def __init__(self, allocator: BlockAllocator, layout: PoolLayout, model: str, enabled: bool):
        self.allocator = allocator
        self.block_size = layout.block_size
        self.enabled = enabled
        self.seed = hash_seed(
            model=model, dtype=layout.dtype, block_size=layout.block_size, layout=layout.to_wire()
        )
        self.queried_tokens = 0  # prompt tokens of every request that looked (the hit rate's base)
        self.hit_tokens = 0  # of those, tokens whose K/V came from the cache
        self.pulled_blocks = 0  # the decode: blocks its pulls were given to copy (not cached)

    def names(self, prompt: Sequence[int]) -> Sequence[bytes]:
        """Names of the prompt's full blocks ([] when the cache is off), computed as they are
        read (LazyNames): a lookup that misses at once costs one hash."""
        return LazyNames(prompt, self.block_size, self.seed) if self.enabled else []

    def hit(self, names: Sequence[bytes], num_tokens: int) -> list[int]:
        """Cached blocks a prompt of `num_tokens` with these names may reuse now: the longest
        cached run from its start, short of the block holding its last token."""
        if not names:
            return []
        return self.allocator.lookup(itertools.islice(names, (num_tokens - 1) // self.block_size))

    @staticmethod
    def complete(names: Sequence[bytes]) -> None:
        """Compute every name of `names` now (a prompt's, from `names`): the prefill calls it
        while the prompt's forward runs, so that naming its blocks afterwards costs nothing."""
        if isinstance(names, LazyNames):
            names.fill()

    def counted(self, num_tokens: int, hit_blocks: int) -> None:
        """A prompt of `num_tokens` got its blocks, `hit_blocks` of them from the cache."""
        if self.enabled:
            self.queried_tokens += num_tokens
            self.hit_tokens += hit_blocks * self.block_size

    def pulled(self, blocks: int) -> None:
        """The decode: a HANDOFF's pull copies `blocks` blocks (its prompt's, less the cached
        ones); counted with the cache on or off, so the two can be compared."""
        self.pulled_blocks += blocks

    def publish(self, request_id: str, names: Sequence[bytes]) -> None:
        """The request's forward wrote its blocks: its full ones may be reused from now on."""
        if names and request_id in self.allocator:
            self.allocator.publish(request_id, names)

    def stats(self) -> dict[str, int]:
        """STATUS_REPLY's `prefix_cache`: counters since start and the cache's blocks now."""
        a = self.allocator
        return {
            "enabled": int(self.enabled),
            "queried_tokens": self.queried_tokens,
            "hit_tokens": self.hit_tokens,
            "pulled_blocks": self.pulled_blocks,
            "evictions": a.evictions,
            "cached_blocks": a.num_cached,
            "named_blocks": a.num_named,
        }


__all__ = ["PrefixCache"]
