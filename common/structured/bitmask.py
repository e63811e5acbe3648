"""Token bitmasks: which tokens a constrained sequence may draw next, and their one masked pass.

A bitmask is int32 [rows, ceil(vocab / 32)] on the host: bit j of word w allows token 32·w + j
(the layout llguidance and xgrammar fill). `apply` unpacks the rows of the constrained sequences
on the logits' device and sets every disallowed logit to -inf in one pass for the batch; a batch
with no constrained sequence never calls it.
"""

from __future__ import annotations

import math

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def words(vocab: int) -> int:
    """int32 words of one row of a `vocab`-token bitmask."""
    return (vocab + 31) // 32


def allocate(rows: int, vocab: int) -> torch.Tensor:
    """A host bitmask of `rows` rows with every token allowed (-1: every bit set)."""
    return torch.full((rows, words(vocab)), -1, dtype=torch.int32)


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return shifts


def allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab]: the bits of `mask` [rows, words] unpacked (on `mask`'s device).
    Read as bytes (little-endian: bit j of a word is bit j % 8 of its byte j // 8), which
    unpacks a quarter of the elements an int32 shift would."""
    as_bytes = mask.contiguous().view(torch.uint8)
    bits = (as_bytes.unsqueeze(-1) >> _shifts(mask.device)) & 1
    return bits.view(mask.shape[0], -1)[:, :vocab].bool()


def apply(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> torch.Tensor:
    """`logits` [B, vocab] where each row rows[i] (ascending) keeps only the tokens mask[i]
    allows, the others -inf, as a new tensor; `mask` [len(rows), words] int32 on the host,
    copied to the logits' device once. The logits as given when `rows` is empty."""
    if not rows:
        return logits
    n, vocab = logits.shape
    ok = allowed(mask.to(logits.device, non_blocking=True), vocab)
    if len(rows) == n:  # every row constrained: one pass, no gather
        return torch.where(ok, logits, -math.inf)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    out = logits.clone()
    out.index_copy_(0, index, torch.where(ok, logits.index_select(0, index), -math.inf))
    return out


def masked_argmax(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> torch.Tensor:
    """int64 [len(rows)] on the logits' device: each row rows[i]'s argmax among the tokens
    mask[i] allows (a step launched ahead carries it as the row's next input)."""
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    ok = allowed(mask.to(logits.device, non_blocking=True), logits.shape[-1])
    return torch.where(ok, logits.index_select(0, index), -math.inf).argmax(dim=-1)


__all__ = ["allocate", "allowed", "apply", "masked_argmax", "words"]
