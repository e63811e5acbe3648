"""The decode daemon's continuous-batching engine: one step at a time, driven by its owner.

Sequences join and leave at step boundaries: `add` queues a sequence, and `step()` takes every
queued sequence into the batch (up to `max_batch`) before it runs; a sequence that finished
leaves the batch after the step that finished it. The owner drives it (DecodeRequests.run):
`await wait_for_work()`, then `results = await step()` — every (sequence, new token) pair of that
step — and answers them. Nothing here calls back up; the engine owns no blocks: whoever removes
or finishes a sequence frees them.

A sequence may join before its KV is in the pool: on CUDA its pull is stream-ordered and
`seq.ready` is the event recorded after the copy on the pull stream. The step that first reads
the sequence makes the compute stream (`rt.stream`) wait on that event on the GPU before it
launches anything (`_wait_for_pulls`, on the torch thread), then clears it. Why that wait binds to
the right record across threads: the event is recorded on the loop thread before `add`, and a
step runs on the torch thread only after `step()` took the sequence into its batch on the loop
thread and submitted it (`rt.run`): the record happened before the wait was called, and each pull
records a fresh event, never re-recorded. The host never waits for a pull here.

Failures are isolated where they can be: a sequence whose logits are not finite, or whose draw
fails, leaves the batch with `seq.error` set (the owner answers its request) and the others go
on. A failure of the step itself (the forward pass) belongs to no sequence: `step()` raises it,
and the owner ends the daemon (exit status 1) rather than live on without decoding.

With `overlap`, `step()` hands the batch to decode_server/ahead.py (AheadSteps: steps launched
one ahead of their read, and the first step launched on KV_LAUNCHED), its one seam; the plain
step below is schedule (admit the queued sequences), run (`_step` on the torch thread), and
postprocess (`_results`). While the batch is empty and `expecting()` says a sequence will join
soon (one awaits its KV), `wait_for_work` keeps the torch thread awake (decode_server/warm.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import structlog
import torch

from common.daemon.runtime import ModelRuntime
from common.model.logits import TokenHistory
from common.model.sampling import (
    SamplingError,
    argmax_isolated,
    draw,
    make_generator,
)
from common.sampling_params import TokenLogprob
from decode_server.ahead import AheadSteps
from decode_server.block_tables import BlockTables
from decode_server.grammars import StepMasks
from decode_server.sequence import Sequence
from decode_server.warm import warm_wait

log = structlog.get_logger(__name__)

Drawn = tuple[list[int | SamplingError], list[TokenLogprob | None] | None]
"""A step's tokens (or the SamplingError of a row that failed alone) and, when some row asks for
them, each row's logprob entry."""


class DecodeEngine:
    def __init__(
        self,
        rt: ModelRuntime,
        *,
        max_batch: int,
        overlap: bool = False,
        hold: Callable[[], bool] | None = None,
        expecting: Callable[[], bool] | None = None,
    ) -> None:
        self.rt = rt
        self.max_batch = max_batch
        self._expecting = expecting  # --warm-wait: a sequence will join soon (warm.py)
        self.warm_waits = 0  # waits with the torch thread kept awake
        self._active: dict[str, Sequence] = {}
        self._waiting: dict[str, Sequence] = {}
        self._work = asyncio.Event()
        # --overlap-steps: steps launched one ahead, and KV_LAUNCHED's first step (ahead.py)
        self.ahead_steps = AheadSteps(self, rt, max_batch, hold) if overlap else None
        self.steps = 0
        # the last step's torch-thread clock (monotonic ns): started, prepared (pulls waited
        # for, inputs computed), replaying (the graph's inputs copied, its replay called),
        # launched (every kernel queued, before the host sync), synced (tokens on the host); set
        # on the torch thread, read on the loop after the step returned
        self.last_step_ns = (0, 0, 0, 0, 0)
        self._tables = BlockTables()  # torch thread only
        self._masks: StepMasks | None = None  # grammar masks (torch thread), made on first use

    @property
    def warm_waits_enabled(self) -> bool:
        return self._expecting is not None

    # ---- membership ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence; it joins the batch at the next step."""
        self._waiting[seq.key] = seq
        if seq.first_on_device is not None:
            assert self.ahead_steps is not None  # launched.py launches only with overlap
            self.ahead_steps.add_first(seq)
        self._work.set()

    def expect(self) -> None:
        """A sequence will join soon (an early HANDOFF): an idle `wait_for_work` looks again
        whether to keep the torch thread awake."""
        if self._expecting is not None:
            self._work.set()

    def remove(self, key: str) -> Sequence | None:
        """Take a sequence out by its key (abort, link loss); its blocks are the caller's to free."""
        if self.ahead_steps is not None:
            self.ahead_steps.remove(key)
        return self._active.pop(key, None) or self._waiting.pop(key, None)

    def sequences(self) -> list[Sequence]:
        return [*self._active.values(), *self._waiting.values()]

    def __len__(self) -> int:
        return len(self._active) + len(self._waiting)

    # what the step ahead holds (ahead.py; nothing without overlap)
    @property
    def launching(self) -> bool:
        return self.ahead_steps is not None and self.ahead_steps.launching

    @property
    def ahead(self) -> bool:
        return self.ahead_steps is not None and self.ahead_steps.ahead

    def first_pending(self) -> list[Sequence]:
        return [] if self.ahead_steps is None else self.ahead_steps.first_pending()

    def in_flight(self, key: str) -> bool:
        return self.ahead_steps is not None and self.ahead_steps.in_flight(key)

    def settle(self) -> None:
        if self.ahead_steps is not None:
            self.ahead_steps.settle()

    @property
    def overlapped(self) -> int:
        return 0 if self.ahead_steps is None else self.ahead_steps.overlapped

    @property
    def held(self) -> int:
        return 0 if self.ahead_steps is None else self.ahead_steps.held

    # ---- steps ---------------------------------------------------------------------------------
    async def wait_for_work(self) -> None:
        """Return once a sequence is in the batch or queued to join it, or a step launched
        ahead is still to be read."""
        while not self._active and not self._waiting and not self.ahead:
            self._work.clear()
            if self._expecting is not None and self._expecting():
                self.warm_waits += 1
                await warm_wait(self._work, self.rt.executor)
            else:
                await self._work.wait()

    async def step(self) -> list[tuple[Sequence, int]]:
        """Admit the queued sequences, run one step on the torch thread, and return each batch
        member's (sequence, token) — token -1 with `seq.error` set for one that failed alone.
        Sequences removed while the step ran are left out. Raises what failed the step itself.
        Overlapped (ahead.py): the results are those of the step launched by the call before
        (none after a launch from idle), and the next step is in flight on return."""
        while self._waiting and len(self._active) < self.max_batch:  # schedule
            key, seq = next(iter(self._waiting.items()))
            del self._waiting[key]
            self._active[key] = seq
        if self.ahead_steps is not None:  # run: one ahead (the seam of the fast paths)
            batch, tokens, logprobs = await self.ahead_steps.step(self._active)
        else:  # run: plain
            batch = list(self._active.values())
            tokens, logprobs = await self.rt.run(self._step, batch) if batch else ([], None)
        if not batch:
            return []
        return self._results(batch, tokens, logprobs)  # postprocess

    def _results(
        self,
        batch: list[Sequence],
        tokens: list[int | SamplingError],
        logprobs: list[TokenLogprob | None] | None,
    ) -> list[tuple[Sequence, int]]:
        """A read step's tokens applied to its sequences still in the batch (module docstring):
        each one's (sequence, token), token -1 for one that failed alone."""
        self.steps += 1
        started, prepared, replaying, launched, synced = self.last_step_ns
        results = []
        for i, (seq, tok) in enumerate(zip(batch, tokens, strict=True)):
            if self._active.get(seq.key) is not seq:
                continue  # removed while the step ran
            if not seq.steps:  # its first step: where the 2nd token's time goes
                seq.marks.stamp("first_step_started", started)
                seq.marks.stamp("first_step_prepared", prepared)
                seq.marks.stamp("first_step_replaying", replaying)
                seq.marks.stamp("first_step_launched", launched)
                seq.marks.stamp("first_step_synced", synced)
            else:  # later steps, for comparison with the first
                seq.later_step_ns += synced - started
            seq.steps += 1
            if isinstance(tok, SamplingError):
                del self._active[seq.key]
                seq.error = str(tok)
                results.append((seq, -1))
                continue
            seq.generated.append(tok)
            seq.last_logprob = None if logprobs is None else logprobs[i]
            if seq.check_finished():
                del self._active[seq.key]
            results.append((seq, tok))
        return results

    def _wait_for_pulls(self, batch: list[Sequence]) -> None:
        """Torch thread, before the step's first launch: the compute stream waits (on the GPU)
        for the pulls of sequences that joined since the last step."""
        for s in batch:
            if s.ready is not None:
                s.ready.wait(self.rt.stream)  # torch.cuda.Event.wait: cudaStreamWaitEvent
                s.ready = None

    def _draw(
        self, batch: list[Sequence], logits: torch.Tensor, argmax: torch.Tensor | None = None
    ) -> Drawn:
        """Torch thread: each sequence's token (grammar masks, penalties and min_tokens applied,
        per row, in one batch) and its logprob entry. A batch of plain sequences (greedy,
        nothing to process or report) takes the argmax without a pass per sequence. Called
        after the step's forward was launched: on CUDA the grammar masks are computed on the
        host while the GPU runs it, and the draw's copy to the host is the step's sync."""
        if all(s.plain for s in batch):
            return argmax_isolated(logits, argmax), None
        masks = None
        if any(s.grammar is not None for s in batch):
            if self._masks is None:
                self._masks = StepMasks(self.max_batch, logits.shape[-1])
            masks = self._masks.fill(batch)
        generators = [make_generator(s.sampling, len(s.generated)) for s in batch]
        params = [s.sampling for s in batch]
        for s in batch:
            if s.sampling.penalized:
                if s.history is None:
                    vocab = logits.shape[-1]
                    s.history = TokenHistory.start(s.prompt, [], vocab, logits.device)
                s.history.catch_up(s.generated)
        out, lps = draw(
            logits,
            params,
            generators,
            steps=[len(s.generated) for s in batch],
            histories=[s.history for s in batch],
            eos_ids=() if not batch else batch[0].stop_ids,
            argmax=argmax,
            masks=masks,
        )
        return out, None if all(lp is None for lp in lps) else lps

    def _inputs(
        self,
        batch: list[Sequence],
        pending: np.ndarray | None = None,
        first: Sequence | None = None,
    ) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
        """Torch thread: the step's (tokens, positions, slots, block tables [n, width]): one
        pass over the batch for the tokens and positions, the tables kept from the last step
        (BlockTables), the slots computed from them at once (sequence.Sequence.slot's rule).
        `pending` [n] bool: rows whose token a step ahead has made and the host not read (one
        position further; their token here is a stale one the device replaces)."""
        # a sequence launched with its first token on the GPU has none on the host yet
        tokens = [s.generated[-1] if s.generated else 0 for s in batch]
        positions = np.fromiter(
            (s.prompt_len + len(s.generated) - 1 for s in batch), np.int64, len(batch)
        )
        if pending is not None:
            positions += pending
        if first is not None:  # batch == [first]: its first token goes right after the prompt
            positions[0] = first.prompt_len
        tables = self._tables.update(batch)
        bs = self.rt.layout.block_size
        slots = tables[np.arange(len(batch)), positions // bs] * bs + positions % bs
        return tokens, positions, slots, tables

    def _step(self, batch: list[Sequence]) -> Drawn:
        """One decode step for `batch` (torch thread): each sequence's next token, or the
        SamplingError that ends that sequence alone, and the tokens' logprobs."""
        started = time.monotonic_ns()
        self._wait_for_pulls(batch)
        dev = self.rt.device
        tokens, positions, slots, tables = self._inputs(batch)
        prepared = time.monotonic_ns()
        if self._graphable(len(batch), tables):
            assert self.rt.graphs is not None
            with self.rt.on_stream():  # replay the CUDA graph of this batch size
                argmax, logits = self.rt.graphs.run(tokens, positions, slots, tables)
                launched = time.monotonic_ns()
                out = self._draw(batch, logits, argmax)
            replaying = self.rt.graphs.replay_ns
            self.last_step_ns = (started, prepared, replaying, launched, time.monotonic_ns())
            return out
        with self.rt.on_stream():
            tok = torch.tensor(tokens, dtype=torch.long).to(dev)
            logits = self._eager(tok, positions, slots, tables)
            launched = time.monotonic_ns()
            out = self._draw(batch, logits)
        self.last_step_ns = (started, prepared, prepared, launched, time.monotonic_ns())
        return out

    def _graphable(self, n: int, tables: np.ndarray) -> bool:
        """Whether a step of n rows with these tables replays a CUDA graph (else: eager)."""
        runner = self.rt.graphs
        return (
            runner is not None
            and runner.bucket_for(n) is not None
            and tables.shape[1] <= runner.max_blocks
        )

    def _eager(
        self, tokens: torch.Tensor, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray
    ) -> torch.Tensor:
        """Torch thread, on the compute stream: one step's logits by launching the model's
        kernels (or the torch path) one by one: the step without a graph."""
        dev = self.rt.device
        pos = torch.from_numpy(positions)
        return self.rt.model.decode_step(
            tokens,
            pos.to(dev),
            torch.from_numpy(slots).to(dev),
            torch.from_numpy(np.ascontiguousarray(tables)).to(dev),
            (pos + 1).to(dev),
            self.rt.pool.tensor,
        )
