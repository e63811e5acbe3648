"""Sampling parameters and the sampler shared by the reference, the prefill and the decode daemon.

Seeded sampling is stateless across processes: the token at generation step i (0 = the token sampled
from prefill's logits) is drawn with a fresh CPU generator seeded from (seed, i). A request that moves
from the prefill daemon to the decode daemon therefore needs no generator state on the wire, only its
seed and its step count, and the single-process reference draws exactly the same numbers. A request
without a seed gets one from `with_seed()` before its first token (the prefill daemon does this and
forwards the resolved parameters in HANDOFF).

Sampling runs on the CPU in fp32 (one [vocab] copy per sampled row), so the draw does not depend on
the device; greedy rows never leave the device until their argmax.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import torch

from common.errors import PdkvError
from common.model import logits as logits_mod
from common.model.logits import TokenHistory
from common.sampling_params import SamplingParams, SamplingParamsError, TokenLogprob
from common.structured import bitmask

Masks = tuple[list[int], torch.Tensor]
"""The grammar masks of a batch's constrained rows: (their rows, host int32 bitmask [len, words])."""

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """64-bit seed of generation step `step` of a request seeded with `seed` (splitmix64 mixing)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def make_generator(params: SamplingParams, step: int) -> torch.Generator | None:
    """The CPU generator for generation step `step` (0 = first token), or None when greedy.

    A random request without a seed gets entropy from the OS (not reproducible); call
    `params.with_seed()` first when the draw must be repeatable or cross processes.
    """
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator(device="cpu").manual_seed(step_seed(seed, step))


class SamplingError(PdkvError):
    """The logits of one row leave nothing to draw from (every entry NaN or -inf)."""


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from `logits` [vocab]: argmax when greedy, else temperature → top-k → top-p.

    Ties in greedy mode go to the lowest id. Random sampling draws from `generator` (required) and
    is numerically safe for any parameters that pass `validate`: it works in fp32 log space with
    the largest logit shifted to 0, so dividing by a tiny temperature gives -inf, never inf - inf;
    top-p always keeps the likeliest token; a NaN entry is never drawn, +inf entries share the
    mass equally. SamplingError when no entry is drawable.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    if generator is None:
        raise SamplingParamsError("random sampling needs a generator (see make_generator)")
    x = _log_weights(logits.detach().to("cpu", torch.float32)) / params.temperature
    ordered, ids = torch.sort(x, descending=True, stable=True)
    if 0 < params.top_k < ordered.numel():
        ordered[params.top_k :] = -math.inf
    if params.top_p < 1.0:
        probs = torch.softmax(ordered, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = mass_before >= params.top_p
        drop[0] = False  # the likeliest token always stays
        ordered = ordered.masked_fill(drop, -math.inf)
    choice = torch.multinomial(torch.softmax(ordered, dim=-1), 1, generator=generator)
    return int(ids[choice])


def _log_weights(x: torch.Tensor) -> torch.Tensor:
    """`x` shifted so its largest drawable entry is 0: NaN → -inf; if any entry is +inf, those
    entries become 0 and the rest -inf. SamplingError when nothing is left."""
    x = torch.nan_to_num(x, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    top = torch.max(x)
    if top == math.inf:
        return torch.where(x == math.inf, 0.0, -math.inf)
    if top == -math.inf:
        raise SamplingError("no finite logit to sample from (all NaN or -inf)")
    return x - top


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` [B, vocab]; row b uses params[b] and generators[b].

    Greedy rows share one argmax and one device-to-host copy; each random row is drawn as `sample`
    would, so a row's token does not depend on the other rows.
    """
    out = torch.argmax(logits, dim=-1).tolist()
    for row, (p, g) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            out[row] = sample(logits[row], p, g)
    return out


def sample_batch_isolated(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    argmax: torch.Tensor | None = None,
    raw: torch.Tensor | None = None,
) -> list[int | SamplingError]:
    """As `sample_batch`, but a row whose logits are not all finite, or whose draw fails, gets a
    SamplingError in its place instead of failing the whole batch (the decode loop fails that
    one request and goes on with the others). `argmax` [B], when the caller has it already (a
    CUDA graph computed it), is used as is; argmax and the finiteness flags reach the host in one
    copy. `raw`, the model's logits when `logits` are processed ones (penalties, masks set
    -inf on purpose), is what the finiteness check reads."""
    out, flags = _argmax_and_finite(logits, argmax, raw)
    for row, (p, g, ok) in enumerate(zip(params, generators, flags, strict=True)):
        if not ok:
            out[row] = SamplingError(_NOT_FINITE)
        elif not p.greedy:
            try:
                out[row] = sample(logits[row], p, g)
            except (SamplingError, RuntimeError, ValueError) as exc:
                out[row] = SamplingError(f"sampling failed: {type(exc).__name__}: {exc}")
    return out


_NOT_FINITE = "the model's logits for this sequence are not finite"


def _argmax_and_finite(
    logits: torch.Tensor, argmax: torch.Tensor | None, raw: torch.Tensor | None = None
) -> tuple[list[int | SamplingError], list[int]]:
    """Each row's argmax (`argmax` as given, when the caller has it) and whether its logits
    (`raw`'s, when given) are all finite, brought to the host in one copy: the step's sync."""
    if argmax is None:
        argmax = torch.argmax(logits, dim=-1)
    finite = torch.isfinite(logits if raw is None else raw).all(dim=-1).to(argmax.dtype)
    ids, flags = torch.stack((argmax, finite)).tolist()
    return ids, flags


def argmax_isolated(
    logits: torch.Tensor, argmax: torch.Tensor | None = None
) -> list[int | SamplingError]:
    """`sample_batch_isolated` for a batch whose every row is greedy with nothing to process
    (no penalty, no min_tokens, no logprobs): each row's argmax, or a SamplingError for a row
    whose logits are not finite; no per-row work unless one is not."""
    out, flags = _argmax_and_finite(logits, argmax)
    return tokens_or_errors(out, flags)


def tokens_or_errors(ids: list[int], flags: list[int]) -> list[int | SamplingError]:
    """Each row's argmax id, or a SamplingError where its finite flag is 0 (its logits were not
    all finite); the list as given when every flag is set."""
    if all(flags):
        return ids  # type: ignore[return-value]
    return [t if ok else SamplingError(_NOT_FINITE) for t, ok in zip(ids, flags, strict=True)]


def carry_tokens(tokens: torch.Tensor, rows: torch.Tensor, argmax: torch.Tensor) -> None:
    """In place on the device: tokens[i] = argmax[rows[i]] where rows[i] >= 0 (a step's input
    token taken from the step before it, not yet read by the host)."""
    taken = argmax.index_select(0, rows.clamp(min=0))
    tokens.copy_(torch.where(rows >= 0, taken, tokens))


def draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    *,
    steps: Sequence[int],
    histories: Sequence[TokenHistory | None],
    eos_ids: frozenset[int] | set[int],
    argmax: torch.Tensor | None = None,
    masks: Masks | None = None,
) -> tuple[list[int | SamplingError], list[TokenLogprob | None]]:
    """One step's tokens for `logits` [B, vocab] (as `sample_batch_isolated`) after each row's
    grammar mask (`masks`: the constrained rows and their bitmask, one masked pass for the
    batch: common.structured.bitmask.apply), penalties and min_tokens mask
    (common.model.logits.process; row b is at generation step steps[b]), and each row's logprobs
    when its params ask (of the raw logits). `argmax` is used only when no row's logits were
    processed."""
    masked = logits if masks is None else bitmask.apply(logits, masks[0], masks[1])
    processed = logits_mod.process(masked, params, histories, steps, eos_ids)
    if processed is not logits:
        argmax = None
    out = sample_batch_isolated(processed, params, generators, argmax=argmax, raw=logits)
    if all(p.logprobs is None for p in params):
        return out, [None] * len(out)
    picked = [t if isinstance(t, int) else None for t in out]
    return out, logits_mod.logprobs(logits, picked, [p.logprobs for p in params])


def finish_reason(
    generated: Sequence[int], params: SamplingParams, stop_ids: frozenset[int] | set[int]
) -> str | None:
    """Why a sequence that has produced `generated` must stop, or None to keep going.

    "stop" when the last token is one of the request's stop_token_ids, or a stop id of the
    model (unless ignore_eos; the stop token stays in the output), "length" when max_tokens are
    out. The reference and the decode daemon both ask this, so they stop at the same token.
    """
    if generated and generated[-1] in params.stop_token_ids:
        return "stop"
    if generated and not params.ignore_eos and generated[-1] in stop_ids:
        return "stop"
    if len(generated) >= params.max_tokens:
        return "length"
    return None
