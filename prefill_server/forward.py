"""Prefill on the torch thread: one varlen forward over pieces of several prompts (a whole prompt,
the part after its cached prefix, or one chunk of a long one), scatter into the pool, the first
token of each prompt whose last piece it is."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.model.paged import slots_for
from common.model.prefill import prefill_many
from common.model.sampling import (
    SamplingError,
    SamplingParams,
    make_generator,
    sample_batch_isolated,
)
from common.modelrt import ModelRuntime
from common.transfer import KVProducer


@dataclass(frozen=True)
class Piece:
    """Positions start .. end-1 of a prompt whose `blocks` already hold the K/V of positions
    0 .. start-1 (a cached prefix, earlier chunks). `sampling` None: not the prompt's last piece,
    nothing is sampled; `slot`: the event recorded once its last piece is written (-1: none)."""

    prompt: list[int]
    start: int
    end: int
    blocks: list[int]
    sampling: SamplingParams | None
    slot: int = -1


def run_prefill_batch(
    rt: ModelRuntime,
    pieces: Sequence[Piece],
    producer: KVProducer | None = None,
    *,
    token_budget: int,
) -> list[int | SamplingError | None]:
    """Write each piece's K/V into its blocks of the pool; for each piece that ends its prompt,
    the prompt's first token, or a SamplingError in its place when that prompt's logits are not
    finite or its draw fails (the other prompts keep theirs); None for the other pieces.

    The pieces run in as few forwards as `token_budget` allows (one, when the caller keeps their
    sum within it), and each prompt's logits and token are those of prefilling it alone: the
    token is drawn with the generator of (seed, step 0), as the single-process reference draws it.
    Runs on the torch thread, on the daemon's stream. On CUDA, the producer records the slot of
    every last piece right after the batch's scatter on that stream, so a peer stream that waits
    on it sees every write of that prompt's K/V, earlier chunks' and cached blocks' included
    (written by earlier forwards on this stream). A failure of the forward itself raises, for
    the whole batch.
    """
    bs = rt.layout.block_size
    tokens = [torch.tensor(p.prompt[p.start : p.end], dtype=torch.long) for p in pieces]
    mappings = [slots_for(p.blocks, p.start, p.end - p.start, bs) for p in pieces]
    starts = [p.start for p in pieces]
    tables = [p.blocks for p in pieces]
    with rt.on_stream():
        logits = prefill_many(
            rt.model,
            tokens,
            mappings,
            rt.pool.tensor,
            token_budget=token_budget,
            starts=starts,
            block_tables=tables,
        )
        last = [i for i, p in enumerate(pieces) if p.sampling is not None]
        if producer is not None:
            for i in last:
                producer.record(pieces[i].slot, rt.stream)
        sampling = [pieces[i].sampling for i in last]
        generators = [make_generator(p, 0) for p in sampling]
        firsts = sample_batch_isolated(logits[last], sampling, generators) if last else []
    out: list[int | SamplingError | None] = [None] * len(pieces)
    for i, first in zip(last, firsts, strict=True):
        out[i] = first
    return out
