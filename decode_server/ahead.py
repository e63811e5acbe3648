"""Steps launched one ahead (`--overlap-steps`), and the first step launched on KV_LAUNCHED: the
engine's fast paths, in one room, entered from one place (`DecodeEngine.step`).

Each `step()` here launches the next step and then reads the one launched by the call before
(decode_server/overlap.py says why nothing wrong is sent or freed), so the results are one step
old and one launched step (`in_flight`) may still write the K/V of the sequences it holds. A
batch with a sequence that is not plain, or while `hold()` says so (a prefill computing a prompt
handed off early), runs the plain way: the step ahead is read first, then each step launches
and is read in one go (the engine's `_step`).

A sequence may join before the host has its first token (KV_LAUNCHED, v12:
decode_server/launched.py): `seq.first_on_device` is a device int64 [1] its pull fills with that
token. Its first step is launched ahead whatever `hold()` says, alone, the token carried from
there on the GPU (as from a step ahead), one position past the prompt; `first_pending()` names
the sequences of the step ahead whose first token the host still lacks, and the owner reads that
step only once it has it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import structlog
import torch

from common.daemon.runtime import ModelRuntime
from common.model.sampling import SamplingError, carry_tokens
from decode_server.grammars import StepMasks, mask_launched
from decode_server.overlap import Launched, Readback
from decode_server.phase import FIRST_DUE
from decode_server.sequence import Sequence

log = structlog.get_logger(__name__)
#: how long the host waits for a step launched on KV_LAUNCHED whose sequence ended before its
#: KV_READY (its prefill may have died mid-forward) before the daemon gives up (exit status 1)
LAUNCHED_STEP_WAIT_S = 30.0
Tokens = list[int | SamplingError]


class StepParts(Protocol):
    """What a launch takes from the engine (torch thread): the plain step and its pieces."""

    last_step_ns: tuple[int, int, int, int, int]

    def _step(self, batch: list[Sequence]) -> tuple[Tokens, list | None]: ...
    def _wait_for_pulls(self, batch: list[Sequence]) -> None: ...
    def _inputs(
        self, batch: list[Sequence], pending: np.ndarray | None, first: Sequence | None
    ) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]: ...
    def _graphable(self, n: int, tables: np.ndarray) -> bool: ...
    def _eager(
        self, tokens: torch.Tensor, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray
    ) -> torch.Tensor: ...


class AheadSteps:
    def __init__(
        self,
        parts: StepParts,
        rt: ModelRuntime,
        max_batch: int,
        hold: Callable[[], bool] | None,
    ) -> None:
        self._parts = parts
        self.rt = rt
        self._hold = hold  # no step is launched ahead while this says so
        self._ahead: Launched | None = None  # the step launched and not read yet
        self._launch_first: Sequence | None = None  # queued with its first token on the GPU
        self._readback = Readback(max_batch, rt.device)
        self._max_batch = max_batch
        self._masks: StepMasks | None = None  # constrained rows' masks (torch thread)
        self.overlapped = 0  # steps launched ahead of the previous step's read
        self.held = 0  # steps that could have been launched ahead but were held (`hold`)

    # ---- what the owner asks ---------------------------------------------------------------------
    def add_first(self, seq: Sequence) -> None:
        """`seq` joins with its first token on the GPU: its first step goes ahead, alone."""
        self._launch_first = seq

    def remove(self, key: str) -> None:
        if self._launch_first is not None and self._launch_first.key == key:
            self._launch_first = None

    @property
    def launching(self) -> bool:
        """Whether a sequence waits to be launched with its first token on the GPU."""
        return self._launch_first is not None

    @property
    def ahead(self) -> bool:
        """Whether a step launched ahead is still to be read."""
        return self._ahead is not None

    def first_pending(self) -> list[Sequence]:
        """The sequences of the step ahead whose first token the host does not have yet
        (launched on KV_LAUNCHED): that step's results wait for them."""
        if self._ahead is None or not self._ahead.firsts:
            return []
        return [s for s in self._ahead.firsts if s.phase in FIRST_DUE]

    def in_flight(self, key: str) -> bool:
        """Whether a step launched and not read yet holds the sequence `key`: that step may
        still write its K/V, so its blocks must not be freed yet."""
        return self._ahead is not None and key in self._ahead.rows

    def settle(self) -> None:
        """Wait (on the host) for the step launched ahead, if any, and drop it: nothing is in
        flight after. For the loop's end; its tokens are not answered."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.done is None:
            return
        try:
            ahead.wait(LAUNCHED_STEP_WAIT_S)
        except RuntimeError as exc:  # the daemon ends anyway; its GPU may never be idle
            log.error("step_ahead_never_completed", error=str(exc))

    # ---- a step ---------------------------------------------------------------------------------
    async def step(self, active: dict[str, Sequence]) -> tuple[list[Sequence], Tokens, list | None]:
        """The step's batch, tokens and logprobs (None when none asked): those of the step
        launched by the call before (none after a launch from idle), the next one launched
        first when it may run ahead too; or, for a batch that may not, the plain step's."""
        ahead = self._ahead
        launch = self._launchable(active, ahead)
        ahead_ok = all(s.steps_ahead for s in launch)
        first = None  # decided here, on the loop: the torch thread reads no phase KV_READY moves
        if ahead is None and self._launch_first is not None:  # launched alone, and ahead
            first, self._launch_first = self._launch_first, None
            launch, ahead_ok = [first], True
        elif ahead_ok and self._hold is not None and self._hold():
            ahead_ok = False
            self.held += 1
        if ahead is None and not (ahead_ok and launch):
            if not launch:
                return [], [], None
            tokens, logprobs = await self.rt.run(self._parts._step, launch)
            return launch, tokens, logprobs
        self._ahead = None
        launched, batch, tokens = await self.rt.run(
            self._cycle, launch if ahead_ok else [], ahead, first
        )
        self._ahead = launched
        return batch, tokens, None

    @staticmethod
    def _launchable(active: dict[str, Sequence], ahead: Launched | None) -> list[Sequence]:
        """The batch of the next launch: every active sequence but those the step ahead
        finishes by length (its token is their last)."""
        if ahead is None:
            return list(active.values())
        rows = ahead.rows
        return [
            s
            for s in active.values()
            if s.key not in rows or len(s.generated) + 1 < s.sampling.max_tokens
        ]

    def _cycle(
        self, launch: list[Sequence], ahead: Launched | None, first: Sequence | None = None
    ) -> tuple[Launched | None, list[Sequence], Tokens]:
        """Torch thread: launch `launch` (if any) behind the step ahead, then read the step
        ahead (if any): (the new launch, the read step's batch and tokens). `first`: `launch`
        is that one sequence, its first token on the GPU (`_launch`)."""
        new = self._launch(launch, ahead, first) if launch else None
        if ahead is None:
            if new is not None and new.logits is not None:
                self._mask(new, None, [])
            return new, [], []
        if not all(s.generated for s in ahead.firsts):  # ended before KV_READY: maybe never
            ahead.wait(LAUNCHED_STEP_WAIT_S)  # the prefill's forward ends: raises, else
        tokens = ahead.read()
        if new is not None and new.logits is not None:  # its masks need these tokens
            self._mask(new, ahead, tokens)
        self._parts.last_step_ns = (*ahead.clock, time.monotonic_ns())
        return new, ahead.batch, tokens

    def _launch(
        self, batch: list[Sequence], ahead: Launched | None, first: Sequence | None = None
    ) -> Launched:
        """Torch thread: queue one step of `batch` (all `steps_ahead`) without reading it; a
        constrained row's token is masked later (`_mask`), before its readback. A sequence in
        `ahead` takes that step's argmax as its token, one position further. `first` (the whole
        batch, nothing ahead): its first token is taken from `first.first_on_device` on the GPU
        and its position is the prompt's end, whatever the host holds by now (KV_READY may
        append that token on the loop meanwhile)."""
        parts, rt = self._parts, self.rt
        started = time.monotonic_ns()
        parts._wait_for_pulls(batch)
        n, rows = len(batch), {} if ahead is None else ahead.rows
        src = np.fromiter((rows.get(s.key, -1) for s in batch), np.int64, n)
        carry = (src, ahead.argmax) if ahead is not None and (src >= 0).any() else None
        if first is not None:
            src[0] = 0
            carry = (src, first.first_on_device)
        tokens, positions, slots, tables = parts._inputs(batch, src >= 0, first)
        prepared = replaying = time.monotonic_ns()
        with rt.on_stream():
            if parts._graphable(n, tables):
                assert rt.graphs is not None
                argmax, logits = rt.graphs.run(tokens, positions, slots, tables, carry=carry)
                replaying = rt.graphs.replay_ns
            else:
                tok = torch.tensor(tokens, dtype=torch.long).to(rt.device)
                if carry is not None:
                    carry_tokens(tok, torch.from_numpy(src).to(rt.device), carry[1])
                logits = parts._eager(tok, positions, slots, tables)
                argmax = torch.argmax(logits, dim=-1)
            constrained = any(s.grammar is not None for s in batch)
            host, done = (None, None) if constrained else self._readback.start(argmax, logits)
        self.overlapped += ahead is not None
        keys = {s.key: i for i, s in enumerate(batch)}
        clock = (started, prepared, replaying, time.monotonic_ns())
        firsts = [] if first is None else [first]
        return Launched(
            batch, keys, argmax, host, done, clock, firsts, logits if constrained else None
        )

    def _mask(self, new: Launched, ahead: Launched | None, tokens: Tokens) -> None:
        """Torch thread: the constrained rows of `new` (launched, its readback not started)
        masked once the host has the tokens of `ahead` (read: `tokens`), then its readback
        started: the masks are filled while the GPU runs `new`'s forward."""
        if self._masks is None:
            self._masks = StepMasks(self._max_batch, new.logits.shape[-1])
        carried = {} if ahead is None else ahead.rows
        keys = [s.key for s in new.batch]
        with self.rt.on_stream():
            mask_launched(self._masks, new.batch, new.argmax, new.logits, carried, tokens, keys)
            new.host, new.done = self._readback.start(new.argmax, new.logits)
        new.logits = None
