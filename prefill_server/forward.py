"""Prefill on the torch thread: forward pass over the prompt, scatter into the pool, first token."""

from __future__ import annotations

import torch

from common.model.paged import slots_for
from common.model.sampling import SamplingParams, make_generator, sample
from common.modelrt import ModelRuntime
from common.transfer import KVProducer


def run_prefill(
    rt: ModelRuntime,
    prompt: list[int],
    blocks: list[int],
    sampling: SamplingParams,
    producer: KVProducer | None = None,
    slot: int = -1,
) -> int:
    """Write the prompt's K/V into `blocks` of the pool and return the first generated token.

    Runs on the torch thread, on the daemon's stream. On CUDA, the producer records event `slot`
    right after the scatter on that stream, so a peer stream that waits on it sees every write of
    this prompt's K/V (slot -1: no event, the CPU case).
    """
    bs = rt.layout.block_size
    tokens = torch.tensor(prompt, dtype=torch.long)
    slots = slots_for(blocks, 0, len(prompt), bs)
    with rt.on_stream():
        logits = rt.model.prefill(
            tokens.to(rt.device, non_blocking=True),
            slots.to(rt.device, non_blocking=True),
            rt.pool.tensor,
        )
        if producer is not None:
            producer.record(slot, rt.stream)
        return sample(logits, sampling, make_generator(sampling, 0))
