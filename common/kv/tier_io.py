"""Copies between a daemon's KV pool and the host tier (common/kv/host_tier.py): what the prefill's
prefix lookup restores and what both daemons write back. One per daemon (ModelRuntime.host_tier).

- `write(pairs)`: pool blocks whose KV is written, by name, into the tier (a name already there is
  skipped). Called on the torch thread, queued after the forward or step that wrote the blocks
  and before anything that could reuse them (later torch work), so the bytes it reads are the KV.
  CPU: a memcpy from the pool's shared memory. CUDA: device → pinned host on a side stream that
  waits for the compute stream (and the compute stream for it), committed once the copy is done.
- `restore(names, blocks)`: the tier's blocks named `names` copied into the fresh pool blocks
  `blocks`, on the tier's own thread, never the torch thread (another request's forward does not
  wait for it); returns how many leading blocks arrived whole (crc and generation checked).
- `Conversation`: the decode's sequence as blocks of prompt + generated tokens, naming each one
  whose KV is written, the chain continued from the prompt's names (the next turn's prompt is
  named the same way, so it finds the answer's blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import structlog
import torch

from common.kv.blockhash import _chain, _pack, block_names
from common.kv.host_index import NONE, Hit
from common.kv.host_tier import HostTier, checksums
from common.kv.pool import KVPool

log = structlog.get_logger(__name__)
INLINE_BYTES = 1 << 20  # a restore this small is copied on the loop (~0.2 ms), not on a thread


class PoolTier:
    def __init__(self, tier: HostTier, pool: KVPool, seed: bytes, stream: Any = None) -> None:
        """`stream`: the daemon's CUDA stream, whose work writes the pool (None: the current)."""
        self.tier, self.pool, self.seed = tier, pool, seed
        self.stream = stream
        self.block_size = pool.layout.block_size
        rows = pool.tensor.view(torch.uint8).reshape(pool.num_blocks, -1)
        self.cuda = rows.device.type == "cuda"
        if self.cuda:
            self.rows = rows
            self.host = torch.from_numpy(tier.slots)  # the tier's slots as one uint8 tensor
            _pin(self.host)
            self.side = torch.cuda.Stream(rows.device)
        else:
            self.rows_np = rows.numpy()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pdkv-tier")  # restores
        # CUDA write-backs' crc + commit: apart, as each waits for its copies (behind a forward)
        self._commits = ThreadPoolExecutor(1, thread_name_prefix="pdkv-tier-commit")
        self.restored_blocks = 0  # blocks restored into the pool (cached_tokens' tier part)
        # pool block -> the latest write-back queued to read it (`write_later`): a restore into
        # that block (freed and taken again meanwhile) waits for it, or the write-back would
        # store the restored bytes under the old block's name
        self._pending: dict[int, Future[int]] = {}
        self.last_copy: Any = None  # CUDA: recorded after the latest write-back's copies

    # -- write back (torch thread) ----------------------------------------------------------------
    def write(self, pairs: Sequence[tuple[bytes, int]]) -> int:
        """Store pool block `block` as `name` for each (name, block); how many were new."""
        if self.cuda:
            return self._write_cuda(pairs)
        return self.tier.store_many([(name, self.rows_np[block]) for name, block in pairs])

    def write_later(self, executor: Executor, pairs: Sequence[tuple[bytes, int]]) -> None:
        """`write(pairs)` queued on `executor` (the torch thread: after the work that wrote the
        blocks, before any later work that could rewrite them); a restore into one of those
        blocks waits for it (`restore_async`). From the loop."""
        future = executor.submit(self.write, pairs)
        future.add_done_callback(_log_failure)
        for _, block in pairs:
            self._pending[block] = future

    def _write_cuda(self, pairs: Sequence[tuple[bytes, int]]) -> int:
        """Reserve, enqueue the device → pinned copies on the side stream (the torch thread's
        part: microseconds), then wait, checksum and commit on the tier's thread (the crc of an
        8B model's 2 MiB block is ~0.4 ms of CPU: not the torch thread's). Returns the number
        of copies enqueued."""
        slots = [(name, *self.tier.reserve(name)) for name, _ in pairs]
        todo = [(s, b) for (_, s, _), (_, b) in zip(slots, pairs, strict=True) if s != NONE]
        if not todo:
            return 0
        compute = self.stream or torch.cuda.current_stream(self.rows.device)
        self.side.wait_stream(compute)  # after the forward or step that wrote the blocks
        with torch.cuda.stream(self.side):
            for slot, block in todo:
                self.host[slot].copy_(self.rows[block], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        self.last_copy = done
        compute.wait_stream(self.side)  # nothing later on the compute stream rewrites them first
        self._commits.submit(self._commit_cuda, done, slots).add_done_callback(_log_failure)
        return len(todo)

    def _commit_cuda(self, done: Any, slots: list[tuple[bytes, int, int]]) -> None:
        done.synchronize()
        taken = [(name, slot, gen) for name, slot, gen in slots if slot != NONE]
        crcs = checksums(
            [n for n, _, _ in taken],
            [self.tier.slots[s] for _, s, _ in taken],
            self.tier.slot_bytes,
        )
        for (_, slot, gen), crc in zip(taken, crcs, strict=True):
            self.tier.commit(slot, gen, crc)

    # -- restore (the tier's thread) --------------------------------------------------------------
    def restore(self, hits: Sequence[Hit], blocks: Sequence[int]) -> int:
        """Copy the looked-up blocks `hits` into `blocks` (fresh, the caller's alone); how many
        leading ones arrived whole. The rest are the caller's to compute."""
        if self.cuda:
            good = self._restore_cuda(hits, blocks)
        else:
            good = self.tier.read_many(hits, [self.rows_np[b] for b in blocks[: len(hits)]])
        self.restored_blocks += good
        return good

    def _restore_cuda(self, hits: Sequence[Hit], blocks: Sequence[int]) -> int:
        with torch.cuda.stream(self.side):
            for hit, block in zip(hits, blocks, strict=False):
                self.rows[block].copy_(self.host[hit.slot], non_blocking=True)
        self.side.synchronize()
        # the crc of the host bytes the DMA read, then the generation
        return self.tier.check_many(hits, [self.tier.slots[h.slot] for h in hits])

    async def restore_async(self, names: Sequence[bytes], blocks: Sequence[int]) -> int:
        """From the loop: look `names` up (microseconds, here), then, once no queued write-back
        still reads the target blocks, copy the hits into `blocks`: here when they are few
        (INLINE_BYTES: a thread hop would cost more, its GIL switch up to 5 ms under load),
        else on the tier's thread, never the torch thread. How many leading blocks arrived."""
        hits = self.tier.lookup(names[: len(blocks)])
        if not hits:
            return 0
        blocks = blocks[: len(hits)]
        waits = [f for b in blocks if (f := self._pending.get(b)) is not None and not f.done()]
        if waits:
            await asyncio.gather(*map(asyncio.wrap_future, waits), return_exceptions=True)
        for b in blocks:
            if (f := self._pending.get(b)) is not None and f.done():
                del self._pending[b]
        if not self.cuda and len(hits) * self.tier.slot_bytes <= INLINE_BYTES:
            return self.restore(hits, blocks)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.restore, hits, blocks)

    # -- the decode's conversation ----------------------------------------------------------------
    def conversation(self, prompt: Sequence[int], names: Sequence[bytes]) -> Conversation:
        """A new sequence's write-back state; `names`: its prompt's block names (the prefix
        cache's, or [] when that is off: computed here then)."""
        if not names and len(prompt) >= self.block_size:
            names = block_names(prompt, self.block_size, self.seed)
        return Conversation(prompt, names[-1] if names else self.seed, self.block_size)

    def stats(self) -> dict[str, int]:
        return {**self.tier.stats(), "restored_blocks": self.restored_blocks}

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        self._commits.shutdown(wait=True)  # a commit started is finished: its slot is READY
        if self.cuda:
            _unpin(self.host)
            self.host = None  # type: ignore[assignment]
        self.rows_np = None
        self.tier.close()


class Conversation:
    """One decode sequence's blocks past its prompt's full ones, named as they fill."""

    __slots__ = ("_base", "_bs", "_next", "_parent", "_tail")

    def __init__(self, prompt: Sequence[int], parent: bytes, block_size: int) -> None:
        self._bs = block_size
        self._base = len(prompt) // block_size * block_size  # first position not in a full block
        self._tail = list(prompt[self._base :])
        self._next = len(prompt) // block_size  # the first block to write back
        self._parent = parent

    def filled(self, generated: Sequence[int], written: int, blocks: Sequence[int]) -> list:
        """(name, pool block) of each block whose KV became whole: `written` positions have KV
        (prompt + generated[:-1] after a step)."""
        bs, out = self._bs, []
        end = min(written // bs, len(blocks))
        if end <= self._next:
            return out
        seq_tokens = self._tail + list(generated)  # from position `_base` on
        tokens = seq_tokens[self._next * bs - self._base : end * bs - self._base]
        names = _chain(_pack(tokens), bs * 8, self._parent)
        for i, name in enumerate(names):
            out.append((name, blocks[self._next + i]))
        self._parent, self._next = names[-1], end
        return out


def _pin(t: torch.Tensor) -> None:
    """Page-lock the tier's mapping for the DMA engine (cudaHostRegister, portable)."""
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 1)
    if int(rc) != 0:
        log.warning("host_tier_not_pinned", error=int(rc))


def _unpin(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def writeback(rt: Any, results: Sequence[tuple[Any, int]]) -> None:
    """The decode, from its loop, after a step's results are applied and before any of its
    sequences' blocks are freed: store every block that step made whole. CPU: now (a memcpy a
    block), as the decode's pulls write freed blocks on this loop. CUDA: the copies enqueued on
    the side stream after the daemon's stream's work, committed later on the tier's thread; a
    block freed meanwhile is not written by a pull before they are done, as every allocation
    that a pull writes calls `settle` first."""
    pt: PoolTier | None = rt.host_tier
    if pt is None:
        return
    pairs = []
    for seq, tok in results:
        conv = seq.tier
        if tok >= 0 and conv is not None:
            pairs += conv.filled(seq.generated, seq.position, seq.blocks)
    if pairs:
        pt.write(pairs)


def settle(rt: Any) -> None:
    """The decode, before it allocates blocks a pull will write: the write-back copies enqueued
    so far (CUDA) are done reading the pool (a host wait only if the last is still running:
    it waits for the step that was in flight when it was enqueued). Nothing on CPU."""
    pt: PoolTier | None = rt.host_tier
    if pt is not None and pt.cuda and pt.last_copy is not None:
        if not pt.last_copy.query():
            pt.last_copy.synchronize()
        pt.last_copy = None


def _log_failure(future: Any) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("host_tier_write_failed", exc_info=future.exception())


__all__ = ["Conversation", "PoolTier", "settle", "writeback"]
