"""The decode daemon's continuous-batching loop.

Sequences join and leave at step boundaries: `add` queues a sequence, and the loop takes every
queued sequence into the batch (up to `max_batch`) before the next step; a sequence that finished
leaves the batch after the step that finished it. Each step runs on the torch thread; the loop
itself never blocks. After each step, `on_step(results)` gets every (sequence, new token) pair of
that step, on the loop; the engine owns no blocks: whoever removes or finishes a sequence frees
them (DecodeRequests).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
import torch

from common.model.sampling import make_generator, sample_batch
from common.modelrt import ModelRuntime
from decode_server.sequence import Sequence

log = structlog.get_logger(__name__)


class DecodeEngine:
    def __init__(
        self,
        rt: ModelRuntime,
        *,
        max_batch: int,
        on_step: Callable[[list[tuple[Sequence, int]]], None],
    ) -> None:
        self.rt = rt
        self.max_batch = max_batch
        self._on_step = on_step
        self._active: dict[str, Sequence] = {}
        self._waiting: dict[str, Sequence] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0

    # ---- membership ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._waiting[seq.key] = seq
        self._wake.set()

    def remove(self, key: str) -> Sequence | None:
        """Take a sequence out by its key (abort, link loss); its blocks are the caller's to free."""
        return self._active.pop(key, None) or self._waiting.pop(key, None)

    def sequences(self) -> list[Sequence]:
        return [*self._active.values(), *self._waiting.values()]

    def __len__(self) -> int:
        return len(self._active) + len(self._waiting)

    # ---- loop ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="decode-loop")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            if not self._active and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
            while self._waiting and len(self._active) < self.max_batch:
                key, seq = next(iter(self._waiting.items()))
                del self._waiting[key]
                self._active[key] = seq
            batch = list(self._active.values())
            try:
                tokens = await self.rt.run(self._step, batch)
            except Exception:
                log.exception("decode_step_failed", batch=len(batch))
                raise
            self.steps += 1
            results = []
            for seq, tok in zip(batch, tokens, strict=True):
                if self._active.get(seq.key) is not seq:
                    continue  # aborted while the step ran
                seq.generated.append(tok)
                if seq.check_finished():
                    del self._active[seq.key]
                results.append((seq, tok))
            self._on_step(results)
            await asyncio.sleep(0)  # let link traffic in between steps

    def _step(self, batch: list[Sequence]) -> list[int]:
        """One decode step for `batch` (torch thread): returns each sequence's next token."""
        dev = self.rt.device
        width = max(len(s.blocks) for s in batch)
        generators = [make_generator(s.sampling, len(s.generated)) for s in batch]
        runner = self.rt.runner
        if runner is not None and runner.bucket_for(len(batch)) and width <= runner.max_blocks:
            with self.rt.on_stream():  # replay the CUDA graph of this batch size
                return runner.step(
                    [s.generated[-1] for s in batch],
                    [s.position for s in batch],
                    [s.slot() for s in batch],
                    [s.blocks for s in batch],
                    [s.sampling for s in batch],
                    generators,
                )
        tables = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):
            tables[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.long)
        tokens = torch.tensor([s.generated[-1] for s in batch], dtype=torch.long)
        positions = torch.tensor([s.position for s in batch], dtype=torch.long)
        slots = torch.tensor([s.slot() for s in batch], dtype=torch.long)
        seq_lens = positions + 1
        with self.rt.on_stream():
            logits = self.rt.model.decode_step(
                tokens.to(dev),
                positions.to(dev),
                slots.to(dev),
                tables.to(dev),
                seq_lens.to(dev),
                self.rt.pool.tensor,
            )
            return sample_batch(logits, [s.sampling for s in batch], generators)
