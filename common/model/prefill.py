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
    starts: Sequence[int] | None = None,
    block_tables: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Logits of each prompt's last token (prompt s with `every_position[s]`: of each of its
    positions) in order [R, vocab], prompts grouped in order into forwards of at most
    `token_budget` tokens (`LlamaModel.prefill_batch`); a longer prompt runs alone (not
    chunked here: the prefill daemon's batcher chunks). Each prompt's result is that of
    prefilling it alone. With `starts` and `block_tables`, prompt s continues a sequence whose
    first starts[s] positions are already in `kv` (LlamaModel.prefill_batch says how).
    `split_rows` cuts the result per prompt."""
    if len(prompts) != len(slot_mappings):
        raise ValueError(f"{len(prompts)} prompts but {len(slot_mappings)} slot mappings")
    every = list(every_position) + [False] * (len(prompts) - len(every_position))
    out: list[torch.Tensor] = []
    start, used = 0, 0
    for i, prompt in enumerate(prompts):
        n = int(prompt.numel())
        if i > start and used + n > token_budget:
            out.append(
                _forward(model, prompts, slot_mappings, kv, every, starts, block_tables, start, i)
            )
            start, used = i, 0
        used += n
    if prompts:
        end = len(prompts)
        out.append(
            _forward(model, prompts, slot_mappings, kv, every, starts, block_tables, start, end)
        )
    return torch.cat(out) if out else torch.empty(0)


def _forward(model, prompts, slots, kv, every, starts, tables, a: int, b: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """One prefill_batch over prompts a..b-1."""
    if starts is None or not any(starts[a:b]):
        return model.prefill_batch(prompts[a:b], slots[a:b], kv, every[a:b])
    return model.prefill_batch(
        prompts[a:b], slots[a:b], kv, every[a:b], starts=starts[a:b], block_tables=tables[a:b]
    )


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
