"""What happens to a batch's logits around the draw: penalties and the min_tokens mask before it,
logprobs after it. Shared by the prefill's first token, the decode's batched step and the
single-process reference, so all three draw from the same processed logits.

Batched: the rows that need processing are gathered once, processed with per-row parameter
tensors (one kernel per rule for the whole batch, no loop per token), and written back into a
copy; a batch that needs none returns the logits unchanged (greedy rows keep their argmax).
Each penalized sequence keeps a `TokenHistory` on the logits' device: the counts of its
generated tokens and a mask of every token of prompt + generated, updated by one indexed add per
new token.

Logprobs are of the raw logits (log-softmax before penalties, masks and temperature: vLLM's
default `raw_logprobs`), computed on the device for the rows that ask and brought to the host in
one copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from common.sampling_params import LOGPROB_FLOOR, SamplingParams, TokenLogprob


@dataclass(slots=True)
class TokenHistory:
    """The tokens a penalized sequence has seen: `counts` [vocab] fp32 of its generated tokens
    (presence, frequency), `seen` [vocab] bool of prompt + generated (repetition)."""

    counts: torch.Tensor
    seen: torch.Tensor
    generated: int = 0  # how many generated tokens are counted

    @classmethod
    def start(
        cls, prompt: Iterable[int], generated: Iterable[int], vocab: int, device: torch.device
    ) -> TokenHistory:
        counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        gen = torch.as_tensor(list(generated), dtype=torch.long, device=device)
        if gen.numel():
            counts.index_add_(0, gen, torch.ones_like(gen, dtype=torch.float32))
            seen[gen] = True
        prompt_ids = torch.as_tensor(list(prompt), dtype=torch.long, device=device)
        if prompt_ids.numel():
            seen[prompt_ids] = True
        return cls(counts, seen, gen.numel())

    def catch_up(self, generated: Sequence[int]) -> None:
        """Count the tokens of `generated` not counted yet (one per decode step: one indexed add)."""
        new = generated[self.generated :]
        if not new:
            return
        ids = torch.as_tensor(list(new), dtype=torch.long, device=self.counts.device)
        self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        self.seen[ids] = True
        self.generated = len(generated)


def needs_processing(params: SamplingParams, step: int) -> bool:
    """True when a row's logits change before the draw at generation `step` (0 = first token)."""
    return params.penalized or step < params.min_tokens


def process(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
    steps: Sequence[int],
    eos_ids: Iterable[int],
) -> torch.Tensor:
    """`logits` [B, vocab] with each row's penalties applied and, before its min_tokens, its
    EOS and stop_token_ids masked to -inf; the same tensor when no row needs either. A
    penalized row needs its history (`histories[b]`)."""
    pen = [b for b, p in enumerate(params) if p.penalized]
    masked = [b for b, p in enumerate(params) if steps[b] < p.min_tokens]
    if not pen and not masked:
        return logits
    out = logits.float().clone()
    if pen:
        out[pen] = _penalize(out[pen], [params[b] for b in pen], [histories[b] for b in pen])
    if masked:
        eos = list(eos_ids)
        rows, cols = [], []
        for b in masked:
            banned = {*eos, *params[b].stop_token_ids}
            banned = {t for t in banned if 0 <= t < out.shape[-1]}
            rows.extend([b] * len(banned))
            cols.extend(banned)
        if rows:
            dev = out.device
            out[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = -math.inf
    return out


def _penalize(
    x: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None]
) -> torch.Tensor:
    """vLLM's order: repetition (prompt + generated), then frequency and presence (generated)."""
    if any(h is None for h in histories):
        raise ValueError("a penalized row needs its TokenHistory")
    counts = torch.stack([h.counts for h in histories])  # type: ignore[union-attr]
    seen = torch.stack([h.seen for h in histories])  # type: ignore[union-attr]
    dev = x.device

    def col(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], device=dev)[:, None]

    rep = col("repetition_penalty")
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - col("frequency_penalty") * counts
    return x - col("presence_penalty") * (counts > 0).float()


def logprobs(
    raw: torch.Tensor, tokens: Sequence[int | None], ks: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """For each row b with ks[b] not None and a token: the logprob of tokens[b] under
    log_softmax(raw[b]) and its ks[b] likeliest alternatives; None for the other rows."""
    rows = [b for b, k in enumerate(ks) if k is not None and tokens[b] is not None]
    out: list[TokenLogprob | None] = [None] * len(ks)
    if not rows:
        return out
    picked = torch.tensor([tokens[b] for b in rows], device=raw.device)
    entries = _entries(raw[rows], picked, max(ks[b] or 0 for b in rows))
    for b, (lp, top) in zip(rows, entries, strict=True):
        out[b] = TokenLogprob(int(tokens[b]), lp, top[: ks[b]])  # type: ignore[arg-type]
    return out


def prompt_logprobs(raw: torch.Tensor, prompt: Sequence[int], k: int) -> list[TokenLogprob]:
    """Logprobs of prompt[1:] from `raw` [T, vocab], the logits at every prompt position (row t
    predicts token t + 1); the first token has none."""
    nxt = torch.as_tensor(list(prompt[1:]), dtype=torch.long, device=raw.device)
    entries = _entries(raw[:-1], nxt, k)
    return [TokenLogprob(t, lp, top) for t, (lp, top) in zip(prompt[1:], entries, strict=True)]


def _entries(
    raw: torch.Tensor, picked: torch.Tensor, k: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """(logprob of picked[r], its k likeliest (id, logprob)) per row of `raw` [R, vocab]: one
    log-softmax on the device, one copy to the host."""
    lsm = torch.log_softmax(raw.float(), dim=-1).nan_to_num(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR)
    chosen = lsm.gather(1, picked[:, None])[:, 0].tolist()
    if k == 0:
        return [(lp, []) for lp in chosen]
    top_lp, top_ids = torch.topk(lsm, k, dim=-1)
    ids, lps = top_ids.tolist(), top_lp.tolist()
    return [(lp, list(zip(i, v, strict=True))) for lp, i, v in zip(chosen, ids, lps, strict=True)]
