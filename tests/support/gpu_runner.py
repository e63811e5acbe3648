"""Greedy generation through prefill_many and the CUDA-graph decode runner, for the GPU tests."""

from __future__ import annotations

import torch

from common.model import SamplingParams, slots_for
from common.model.prefill import prefill_many


def runner_generate(model, prompts, max_tokens, *, block_size=16, max_batch=8):
    """Greedy tokens of `prompts` through prefill_many and the graph runner (shrinking batch)."""
    from common.model.runner import DecodeRunner

    width = max(-(-(len(p) + max_tokens) // block_size) for p in prompts)
    n = len(prompts)
    kv = model.new_kv_cache(width * n + 1, block_size)
    tables = (torch.arange(width * n).view(width, n).t() + 1).tolist()  # interleaved, never 0
    runner = DecodeRunner(model, kv, max_batch=max_batch, max_blocks=width)
    runner.capture()
    slots = [slots_for(tables[i], 0, len(p), block_size) for i, p in enumerate(prompts)]
    first = prefill_many(model, [torch.tensor(p) for p in prompts], slots, kv).argmax(-1)
    out = [[t] for t in first.tolist()]
    greedy = SamplingParams(max_tokens=max_tokens)
    active = list(range(n))
    logits_seen = []
    while active:
        pos = [len(prompts[i]) + len(out[i]) - 1 for i in active]
        step_slots = [
            int(slots_for(tables[i], p, 1, block_size)) for i, p in zip(active, pos, strict=True)
        ]
        args = ([out[i][-1] for i in active], pos, step_slots, [tables[i] for i in active])
        argmax, logits = runner.run(*args)
        toks = argmax.tolist()
        logits_seen.append(logits[0].clone())
        if len(out[active[0]]) == 2:  # `step` samples the same greedy tokens as `run`'s argmax
            again = runner.step(*args, [greedy] * len(active), [None] * len(active))
            assert again == toks
        for i, t in zip(active, toks, strict=True):
            out[i].append(t)
        active = [i for i in active if len(out[i]) < max_tokens]
    return out, logits_seen
