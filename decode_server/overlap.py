"""A decode step launched before the previous step's tokens are read (overlapped steps).

Without it, the GPU idles between two steps while the host reads a step's tokens, the loop
answers them (STEP_TOKENS, FINISH, admission) and the next step's inputs are filled: at 256
sequences in flight that was a large part of each step (issue 24). With it, for a batch whose
every sequence is plain (greedy, nothing drawn or reported on the host: `Sequence.plain`; or
greedy under a grammar, its row's argmax masked before it is read or carried:
`Sequence.steps_ahead`, decode_server/ahead.py), the engine launches step N+1 before it reads step N: a sequence that was in step N gets N's device
argmax as its input token (`sampling.carry_tokens`, on the GPU) at the position after N's; the host
then reads N's tokens from pinned memory (`Launched.read`) while the GPU runs N+1, and the loop's
work on N's results overlaps it.

What that means for a sequence, and why nothing wrong is sent or freed:
- one that step N finishes by length is known before N+1 is launched and left out of it;
- one that step N finishes by a stop token is in N+1 already: N+1's token for it is dropped
  (its result is never answered: it left the batch when N's was), and the K/V N+1 writes for it
  lands at a position inside the blocks it reserved for its whole life (it had tokens left), past
  its prompt, so never in a block another sequence shares;
- its blocks are freed only once every launched step holding it has been read
  (`DecodeEngine.in_flight`): a pull into blocks freed earlier could race that write.
A batch with any other sequence runs the ordinary way: the step ahead is read first, then each
step launches and is read in one go.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from common.model.sampling import SamplingError, tokens_or_errors
from decode_server.sequence import Sequence


@dataclass(slots=True, eq=False)
class Launched:
    """A step launched and not read yet: its batch, its argmax on the device (the next step's
    carried tokens) and that argmax with each row's finite flag on their way to `host`."""

    batch: list[Sequence]
    rows: dict[str, int]  # seq.key -> its row in this step
    argmax: torch.Tensor  # [n] int64 on the device; valid until the next step's launch
    host: Any  # [2, n] int64 host tensor: ids, finite flags, once `done` completed (None: not yet)
    done: Any  # torch.cuda.Event recorded after the copy; None where the copy was synchronous
    # monotonic ns: the launch began, its inputs were computed, its graph's replay was called,
    # every kernel was queued (DecodeEngine.last_step_ns)
    clock: tuple[int, int, int, int]
    # the sequences launched with their first token on the GPU (KV_LAUNCHED: engine.py)
    firsts: list[Sequence] = field(default_factory=list)
    # a step with constrained rows: its logits, until their masks are applied and its readback
    # started (AheadSteps._cycle, once the step before is read); None once started
    logits: Any = None

    def wait(self, bound_s: float) -> None:
        """Wait on the host for the step to complete, polling, at most `bound_s`: RuntimeError
        past it. For a step whose completion is not certain: one launched on KV_LAUNCHED whose
        prefill never sent KV_READY may wait on a forward that will never end."""
        if self.done is None:
            return
        end = time.monotonic() + bound_s
        while not self.done.query():
            if time.monotonic() > end:
                raise RuntimeError(
                    f"a decode step launched on KV_LAUNCHED did not complete in {bound_s:g} s: "
                    "the prefill forward it waits on never ended (its daemon died?)"
                )
            time.sleep(0.001)

    def read(self) -> list[int | SamplingError]:
        """Each row's token, or the SamplingError of a row whose logits were not finite (waits
        for the step on the host: the step's one sync)."""
        if self.done is not None:
            self.done.synchronize()
        ids, flags = self.host.tolist()
        return tokens_or_errors(ids, flags)


class Readback:
    """The host buffers launched steps' tokens are copied into: two, used in turn, since at most
    one launched step is unread when the next is launched (pinned, with an event each, on CUDA).
    Torch thread only."""

    def __init__(self, max_batch: int, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._bufs = [
            torch.zeros(2 * max_batch, dtype=torch.int64, pin_memory=self._cuda) for _ in range(2)
        ]
        self._events = [torch.cuda.Event() if self._cuda else None for _ in range(2)]
        self._turn = 0

    def start(self, argmax: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Queue the copy of (argmax, finite flags of `logits`' rows) to the host: the [2, n]
        host view and the event that says it landed (None on the CPU, where it has)."""
        n = argmax.shape[0]
        finite = torch.isfinite(logits).all(dim=-1).to(argmax.dtype)
        host = self._bufs[self._turn][: 2 * n].view(2, n)
        event = self._events[self._turn]
        self._turn ^= 1
        host.copy_(torch.stack((argmax, finite)), non_blocking=self._cuda)
        if event is not None:
            event.record()
        return host, event


__all__ = ["Launched", "Readback"]
