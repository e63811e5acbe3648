"""Prefill on the torch thread: one varlen forward over several prompts, scatter into the pool,
each prompt's first token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.model import logits as logits_mod
from common.model.logits import TokenHistory
from common.model.paged import slots_for
from common.model.prefill import prefill_many, split_rows
from common.model.sampling import SamplingError, SamplingParams, draw, make_generator
from common.modelrt import ModelRuntime
from common.sampling_params import TokenLogprob
from common.transfer import Producer


@dataclass(frozen=True, slots=True)
class FirstToken:
    """What one prompt's prefill gives its request: the first token (None when max_tokens is 0:
    only the prompt is scored), its logprob entry and the prompt's (when asked)."""

    token: int | None
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


def run_prefill_batch(
    rt: ModelRuntime,
    prompts: Sequence[list[int]],
    blocks: Sequence[list[int]],
    sampling: Sequence[SamplingParams],
    producer: Producer | None = None,
    slots: Sequence[int] = (),
    *,
    token_budget: int,
) -> list[FirstToken | SamplingError]:
    """Write each prompt's K/V into its `blocks` of the pool; each prompt's first token (with
    its logprobs and the prompt's when its params ask), or a SamplingError in its place when
    that prompt's logits are not finite or its draw fails (the other prompts keep theirs).

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
    every = [p.prompt_logprobs is not None for p in sampling]
    with rt.on_stream():
        out = prefill_many(
            rt.model,
            tokens,
            mappings,
            rt.pool.tensor,
            token_budget=token_budget,
            every_position=every,
        )
        if producer is not None:
            for slot in slots:
                producer.record(slot, rt.stream)
        logits, full = split_rows(out, [len(p) for p in prompts], every)
        vocab, dev = logits.shape[-1], logits.device
        histories = [
            TokenHistory.start(pr, [], vocab, dev) if p.penalized else None
            for pr, p in zip(prompts, sampling, strict=True)
        ]
        generators = [make_generator(p, 0) for p in sampling]
        firsts, lps = draw(
            logits,
            sampling,
            generators,
            steps=[0] * len(prompts),
            histories=histories,
            eos_ids=rt.model.config.stop_token_ids,
        )
        answers: list[FirstToken | SamplingError] = []
        for s, (first, lp) in enumerate(zip(firsts, lps, strict=True)):
            if isinstance(first, SamplingError):
                answers.append(first)
                continue
            k = sampling[s].prompt_logprobs
            scored = None if k is None else logits_mod.prompt_logprobs(full[s], prompts[s], k)
            if sampling[s].max_tokens == 0:
                answers.append(FirstToken(None, None, scored))
            else:
                answers.append(FirstToken(first, lp, scored))
        return answers
