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
    every_position: Sequence[bool] = (),
) -> torch.Tensor:
    """Logits of each prompt's last token (prompt s with `every_position[s]`: of each of its
    positions) in order [R, vocab], prompts grouped in order into forwards of at most
    `token_budget` tokens (`LlamaModel.prefill_batch`); a longer prompt runs alone (not
    chunked). Each prompt's result is that of prefilling it alone. `split_rows` cuts the result
    per prompt."""
    if len(prompts) != len(slot_mappings):
        raise ValueError(f"{len(prompts)} prompts but {len(slot_mappings)} slot mappings")
    every = list(every_position) + [False] * (len(prompts) - len(every_position))
    out: list[torch.Tensor] = []
    start, used = 0, 0
    for i, prompt in enumerate(prompts):
        n = int(prompt.numel())
        if i > start and used + n > token_budget:
            out.append(
                model.prefill_batch(prompts[start:i], slot_mappings[start:i], kv, every[start:i])
            )
            start, used = i, 0
        used += n
    if prompts:
        out.append(model.prefill_batch(prompts[start:], slot_mappings[start:], kv, every[start:]))
    return torch.cat(out) if out else torch.empty(0)


def split_rows(
    logits: torch.Tensor, lengths: Sequence[int], every_position: Sequence[bool]
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """`prefill_many`'s result as (last-token logits [S, vocab], per prompt its logits at every
    position [T, vocab] where `every_position` asked, else None)."""
    if not any(every_position):
        return logits, [None] * len(lengths)
    last, full, at = [], [], 0
    for s, n in enumerate(lengths):
        want = s < len(every_position) and every_position[s]
        rows = n if want else 1
        part = logits[at : at + rows]
        at += rows
        last.append(part[-1])
        full.append(part if want else None)
    return torch.stack(last), full
