"""The grammar of a constrained sequence in the decode (issue 42), rebuilt from the HANDOFF.

The HANDOFF carries the request's `structured` spec and the tokens so far (the prefill's first
token, in HANDOFF or KV_READY): `start` compiles the spec (the daemon's cache: a schema seen
before is not compiled again) into a fresh matcher, which accepts the generated tokens as they
come (`SequenceGrammar.catch_up`, from `Sequence.check_finished`), so it always stands after the
last one. `StepMasks.fill` writes the masks of a step's constrained rows into one host bitmask,
on the torch thread after the step's forward was launched (on CUDA the GPU runs it meanwhile);
a batch without a constrained sequence never gets here.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import structlog
import torch

from common.daemon.runtime import ModelRuntime
from common.sampling_params import SamplingParams
from common.structured import Matcher, bitmask, grammars_for

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class SequenceGrammar:
    """A sequence's matcher and how many of its generated tokens it has accepted."""

    matcher: Matcher
    accepted: int = 0
    refused: int | None = None  # a token the grammar did not allow (a bug if it ever happens)

    def catch_up(self, generated: Seq[int]) -> None:
        """Accept the tokens of `generated` not accepted yet (one per step)."""
        while self.accepted < len(generated) and self.refused is None:
            token = generated[self.accepted]
            if not self.matcher.accept(token):
                self.refused = token
                return
            self.accepted += 1

    @property
    def done(self) -> bool:
        """Whether the sequence ends here: its text is complete (or a token broke it)."""
        return self.refused is not None or self.matcher.terminated


def start(
    rt: ModelRuntime, sampling: SamplingParams, stop_ids: frozenset[int]
) -> SequenceGrammar | None:
    """The grammar of a HANDOFF's request (None when unconstrained); GrammarError naming the
    problem when its spec does not compile (the caller refuses the HANDOFF)."""
    if sampling.structured is None:
        return None
    cache = grammars_for(rt.tokenizer, rt.model.config.vocab_size, stop_ids)
    return SequenceGrammar(cache.compile(sampling.structured).matcher())


class _Row(Protocol):
    """What a mask needs of a sequence (decode_server.sequence.Sequence has it)."""

    request_id: str
    generated: list[int]
    grammar: SequenceGrammar | None


class StepMasks:
    """The host bitmask a step's constrained rows are filled into (torch thread only)."""

    def __init__(self, max_batch: int, vocab: int) -> None:
        self._mask = bitmask.allocate(max_batch, vocab)

    def fill(self, batch: Seq[_Row]) -> tuple[list[int], torch.Tensor] | None:
        """(the constrained rows of `batch`, their bitmask rows), or None when it has none."""
        rows = [i for i, s in enumerate(batch) if s.grammar is not None]
        if not rows:
            return None
        mask = self._mask[: len(rows)]
        mask.zero_()
        for j, i in enumerate(rows):
            g = batch[i].grammar
            assert g is not None
            g.catch_up(batch[i].generated)
            if g.refused is None:
                g.matcher.fill(mask, j)
            else:  # nothing allowed: the draw fails this sequence alone (SamplingError)
                log.error("grammar_refused_token", request_id=batch[i].request_id, token=g.refused)
        return rows, mask


def mask_launched(
    masks: StepMasks,
    batch: Seq[_Row],
    argmax: torch.Tensor,
    logits: torch.Tensor,
    carried: dict[str, int],
    tokens: Seq[object],
    keys: Seq[str],
) -> None:
    """Torch thread, for a step launched ahead (decode_server/ahead.py) with constrained rows:
    each such row's matcher first accepts the token the step before made for it (`carried`:
    its key → row in `tokens`, that step's tokens just read; not yet in `generated`), then its
    mask is filled and `argmax` [n] (on the device) gets the masked argmax in its row: the
    token the host reads and the next launch carries. `keys[i]` is batch[i]'s key."""
    for s, key in zip(batch, keys, strict=True):
        g = s.grammar
        row = carried.get(key)
        if g is None or row is None or g.refused is not None:
            continue
        token = tokens[row]
        if isinstance(token, int) and g.accepted == len(s.generated):
            if g.matcher.accept(token):
                g.accepted += 1
            else:
                g.refused = token
    filled = masks.fill(batch)
    if filled is None:
        return
    rows, mask = filled
    index = torch.tensor(rows, dtype=torch.long, device=argmax.device)
    argmax.index_copy_(0, index, bitmask.masked_argmax(logits, rows, mask))


__all__ = ["SequenceGrammar", "StepMasks", "mask_launched", "start"]
