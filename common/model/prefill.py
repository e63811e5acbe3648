"""Prefill of many prompts in as few forwards as a token budget allows (varlen batching)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.model.llama import LlamaModel

DEFAULT_TOKEN_BUDGET = 8192


def prefill_many(
    model: LlamaModel,
    prompts: Sequence[torch.Tensor],
    slot_mappings: Sequence[torch.Tensor],
    kv: torch.Tensor,
    *,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
) -> torch.Tensor:
    """Logits [S, vocab] of each prompt's last token, prompts grouped in order into forwards of at
    most `token_budget` tokens (`LlamaModel.prefill_batch`); a longer prompt runs alone (not
    chunked). Each prompt's result is that of prefilling it alone."""
    if len(prompts) != len(slot_mappings):
        raise ValueError(f"{len(prompts)} prompts but {len(slot_mappings)} slot mappings")
    out: list[torch.Tensor] = []
    start, used = 0, 0
    for i, prompt in enumerate(prompts):
        n = int(prompt.numel())
        if i > start and used + n > token_budget:
            out.append(model.prefill_batch(prompts[start:i], slot_mappings[start:i], kv))
            start, used = i, 0
        used += n
    if prompts:
        out.append(model.prefill_batch(prompts[start:], slot_mappings[start:], kv))
    return torch.cat(out) if out else torch.empty(0)
