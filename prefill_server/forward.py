"""Prefill on the torch thread: one varlen forward over several prompts, scatter into the pool,
each prompt's first token."""

from __future__ import annotations

from collections.abc import Sequence

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
from common.transfer import Producer


def run_prefill_batch(
    rt: ModelRuntime,
    prompts: Sequence[list[int]],
    blocks: Sequence[list[int]],
    sampling: Sequence[SamplingParams],
    producer: Producer | None = None,
    slots: Sequence[int] = (),
    *,
    token_budget: int,
) -> list[int | SamplingError]:
    """Write each prompt's K/V into its `blocks` of the pool; each prompt's first token, or a
    SamplingError in its place when that prompt's logits are not finite or its draw fails (the
    other prompts keep theirs).

    The prompts run in as few forwards as `token_budget` allows (one, when the caller keeps their
    sum within it), and each prompt's logits and token are those of prefilling it alone: the
    token is drawn with the generator of (seed, step 0), as the single-process reference draws it.
    Runs on the torch thread, on the daemon's stream. On CUDA, the producer records every event
    `slots[i]` right after the batch's scatter on that stream, so a peer stream that waits on it
    sees every write of prompt i's K/V (slot -1: no event, the CPU case). A failure of the forward
    itself raises, for the whole batch.
    """
    bs = rt.layout.block_size
    tokens = [torch.tensor(p, dtype=torch.long) for p in prompts]
    mappings = [slots_for(b, 0, len(p), bs) for p, b in zip(prompts, blocks, strict=True)]
    with rt.on_stream():
        logits = prefill_many(rt.model, tokens, mappings, rt.pool.tensor, token_budget=token_budget)
        if producer is not None:
            for slot in slots:
                producer.record(slot, rt.stream)
        generators = [make_generator(p, 0) for p in sampling]
        return sample_batch_isolated(logits, sampling, generators)
