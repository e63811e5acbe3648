"""The decode daemon's continuous-batching loop.

Sequences join and leave at step boundaries: `add` queues a sequence, and the loop takes every
queued sequence into the batch (up to `max_batch`) before the next step; a sequence that finished
leaves the batch after the step that finished it. Each step runs on the torch thread; the loop
itself never blocks. After each step, `on_step(results)` gets every (sequence, new token) pair of
that step, on the loop; the engine owns no blocks: whoever removes or finishes a sequence frees
them (DecodeRequests).

Failures are isolated where they can be: a sequence whose logits are not finite, or whose draw
fails, leaves the batch with `seq.error` set (the callback answers its request) and the others go
on. A failure of the step itself (the forward pass) belongs to no sequence: the loop logs it and
calls `on_fatal`, and the daemon exits non-zero rather than live on without decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
import torch

from common.model.sampling import SamplingError, make_generator, sample_batch_isolated
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
        on_fatal: Callable[[BaseException], None],
    ) -> None:
        self.rt = rt
        self.max_batch = max_batch
        self._on_step = on_step
        self._on_fatal = on_fatal
        self.failure: BaseException | None = None  # why the loop ended, if it did
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
        """Cancel the loop; a loop that already failed has been reported (on_fatal), not raised."""
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def running(self) -> bool:
        """True while the loop can still decode."""
        return self._task is not None and not self._task.done()

    async def _loop(self) -> None:
        try:
            while True:
                if not self._active and not self._waiting:
                    self._wake.clear()
                    await self._wake.wait()
                await self._step_once()
                await asyncio.sleep(0)  # let link traffic in between steps
        except Exception as exc:  # not attributable to one sequence: the daemon must end
            self.failure = exc
            log.critical("decode_loop_failed", batch=len(self._active), exc_info=exc)
            self._on_fatal(exc)

    async def _step_once(self) -> None:
        while self._waiting and len(self._active) < self.max_batch:
            key, seq = next(iter(self._waiting.items()))
            del self._waiting[key]
            self._active[key] = seq
        batch = list(self._active.values())
        tokens = await self.rt.run(self._step, batch)
        self.steps += 1
        results = []
        for seq, tok in zip(batch, tokens, strict=True):
            if self._active.get(seq.key) is not seq:
                continue  # aborted while the step ran
            if isinstance(tok, SamplingError):
                del self._active[seq.key]
                seq.error = str(tok)
                results.append((seq, -1))
                continue
            seq.generated.append(tok)
            if seq.check_finished():
                del self._active[seq.key]
            results.append((seq, tok))
        self._on_step(results)

    def _step(self, batch: list[Sequence]) -> list[int | SamplingError]:
        """One decode step for `batch` (torch thread): each sequence's next token, or the
        SamplingError that ends that sequence alone."""
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
            return sample_batch_isolated(logits, [s.sampling for s in batch], generators)
