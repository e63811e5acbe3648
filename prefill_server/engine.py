"""Prefill on the torch thread: forward pass over the prompt, scatter into the pool, first token."""

from __future__ import annotations

import torch

from common.model.paged import slots_for
from common.model.sampling import SamplingParams, make_generator, sample
from common.modelrt import ModelRuntime


def run_prefill(
    rt: ModelRuntime, prompt: list[int], blocks: list[int], sampling: SamplingParams
) -> int:
    """Write the prompt's K/V into `blocks` of the pool and return the first generated token.

    Runs on the torch thread. On CUDA the caller records the handoff event after this returns,
    on the same thread and stream, so the event orders after every write of the scatter.
    """
    bs = rt.layout.block_size
    tokens = torch.tensor(prompt, dtype=torch.long)
    slots = slots_for(blocks, 0, len(prompt), bs)
    logits = rt.model.prefill(tokens.to(rt.device), slots.to(rt.device), rt.pool.tensor)
    return sample(logits, sampling, make_generator(sampling, 0))
