"""The single-process reference: prefill and decode in one process, no handoff.

This is the correctness anchor: the disaggregated path's greedy output must equal `generate` token
for token. It uses the same model forward (`prefill_batch`, `decode_step`; on CUDA the decode
daemon replays that step's kernels from CUDA graphs), the same sampler, the same per-step seeding
and the same stop rule (`finish_reason`) as the daemons, over its own small
pool tensor whose block ids are interleaved between sequences so block tables are never trivially
contiguous.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import msgspec
import torch

from common.model.llama import LlamaModel
from common.model.logits import TokenHistory
from common.model.paged import blocks_for, slots_for
from common.model.prefill import prefill_many
from common.model.sampling import (
    SamplingError,
    SamplingParams,
    draw,
    finish_reason,
    make_generator,
)


def generate(
    model: LlamaModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    block_size: int = 16,
    stop_ids: Collection[int] | None = None,
) -> list[int]:
    """Generated ids of one prompt (first token from prefill's logits included; a final stop token
    included). Stops at max_tokens or a stop id (default: the config's EOS ids) unless ignore_eos.
    Decodes with batch size 1."""
    return generate_batch(model, [prompt_ids], params, block_size=block_size, stop_ids=stop_ids)[0]


#: A greedy token may differ from the reference's only where the reference's logits tie to this
#: relative margin (`compare`): fp32 sums in another order (a decode batch of another size, a
#: prefill of several prompts) move a logit by ~1e-6 of its size, and a tie then goes either way.
TIE_MARGIN = 1e-5


@dataclass(frozen=True)
class Tie:
    """Where a greedy output parted from the reference at a numerical tie: generated token `at`
    is `got` where the reference gave `want`, whose logit is `margin` above `got`'s."""

    at: int
    want: int
    got: int
    margin: float


def compare(
    model: LlamaModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    got: Sequence[int],
    *,
    whole: bool = True,
    block_size: int = 16,
    tie_margin: float = TIE_MARGIN,
) -> tuple[bool, list[Tie]]:
    """Whether `got` is `generate`'s output (`whole`), or a prefix of it for a request cut
    short, and the ties it went through. A greedy output without penalties may part from the
    reference where the reference's top logit is within `tie_margin` (relative) of `got`'s token:
    the two sum in different orders, so exact equality there is luck, not correctness. From
    such a token on, the reference goes on from `got`'s choice and must match again (a stop
    token taken at a tie must end the output); any other difference, or any difference of a
    sampled, penalized or min_tokens output (whose draw is not the raw logits' argmax), is a
    mismatch."""
    prompt, got = list(prompt_ids), list(got)
    ties: list[Tie] = []
    taken: list[int] = []  # got's tokens up to and including its last tie
    while True:
        rest = got[len(taken) :]
        left = msgspec.structs.replace(
            params,
            max_tokens=params.max_tokens - len(taken),
            min_tokens=max(0, params.min_tokens - len(taken)),
        )
        want = generate(model, prompt + taken, left, block_size=block_size)
        if rest == (want if whole else want[: len(rest)]):
            return True, ties
        k = next((i for i, (a, b) in enumerate(zip(rest, want, strict=False)) if a != b), None)
        if k is None or not params.greedy or params.penalized or params.min_tokens:
            return False, ties  # a length that differs, or not a plain argmax of the logits
        at = len(taken) + k
        with torch.inference_mode():
            logits = model.forward_dense(torch.tensor(prompt + got[:at]))[-1]
        top = float(logits.max())
        margin = top - float(logits[got[at]])
        if margin > tie_margin * max(1.0, abs(top)):
            return False, ties
        ties.append(Tie(at, want[k], got[at], margin))
        taken = got[: at + 1]
        if finish_reason(taken, params, frozenset(model.config.stop_token_ids)) is not None:
            return len(taken) == len(got), ties  # the tie's token ended it: nothing may follow
        if len(taken) == len(got):  # cut short right after the tie
            return not whole, ties


def generate_batch(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    block_size: int = 16,
    stop_ids: Collection[int] | None = None,
) -> list[list[int]]:
    """`generate` for several prompts, decoded together as one continuously shrinking batch.

    The prompts are prefilled together (varlen forwards, `prefill_many`); then each step decodes
    every unfinished sequence in one `decode_step`. A sequence's tokens must not depend on its batch mates (tests assert it).
    """
    n = len(prompts)
    per_row = [params] * n if isinstance(params, SamplingParams) else list(params)
    if len(per_row) != n:
        raise ValueError(f"{n} prompts but {len(per_row)} sampling parameter sets")
    per_row = [p.validate().with_seed() for p in per_row]
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; encode at least one token (e.g. BOS)")
    stops = frozenset(model.config.stop_token_ids if stop_ids is None else stop_ids)

    lengths = [len(pr) + p.max_tokens for pr, p in zip(prompts, per_row, strict=True)]
    width = max(blocks_for(length, block_size) for length in lengths)
    kv = model.new_kv_cache(width * n, block_size)
    # Sequence i owns blocks i, i+n, i+2n, ...: interleaved, so tables exercise real paging.
    tables = torch.arange(width * n).view(width, n).t().contiguous()  # [n, width]

    slots = [slots_for(tables[i], 0, len(prompt), block_size) for i, prompt in enumerate(prompts)]
    logits = prefill_many(model, [torch.tensor(list(p)) for p in prompts], slots, kv)
    histories = [
        TokenHistory.start(pr, [], logits.shape[-1], logits.device) if p.penalized else None
        for pr, p in zip(prompts, per_row, strict=True)
    ]
    generators = [make_generator(p, 0) for p in per_row]
    firsts = _checked(
        draw(logits, per_row, generators, steps=[0] * n, histories=histories, eos_ids=stops)[0]
    )
    outputs = [[t] for t in firsts]

    active = [i for i in range(n) if finish_reason(outputs[i], per_row[i], stops) is None]
    while active:
        _decode_once(
            model, kv, tables, block_size, prompts, outputs, per_row, active, histories, stops
        )
        active = [i for i in active if finish_reason(outputs[i], per_row[i], stops) is None]
    return outputs


def _decode_once(
    model: LlamaModel,
    kv: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    prompts: Sequence[Sequence[int]],
    outputs: list[list[int]],
    params: list[SamplingParams],
    active: list[int],
    histories: list[TokenHistory | None],
    stops: frozenset[int],
) -> None:
    """Feed each active sequence's last token at its position and append the sampled next token."""
    positions = torch.tensor([len(prompts[i]) + len(outputs[i]) - 1 for i in active])
    rows = torch.tensor(active)
    used_blocks = int(positions.max()) // block_size + 1
    block_tables = tables[rows, :used_blocks]
    slots = block_tables.gather(1, (positions // block_size)[:, None])[:, 0] * block_size
    slots += positions % block_size
    logits = model.decode_step(
        torch.tensor([outputs[i][-1] for i in active]),
        positions,
        slots,
        block_tables,
        positions + 1,
        kv,
    )
    batch_params = [params[i] for i in active]
    generators = [make_generator(params[i], len(outputs[i])) for i in active]
    batch_histories = [histories[i] for i in active]
    for i in active:
        if (h := histories[i]) is not None:
            h.catch_up(outputs[i])
    steps = [len(outputs[i]) for i in active]
    tokens, _ = draw(
        logits, batch_params, generators, steps=steps, histories=batch_histories, eos_ids=stops
    )
    for i, token in zip(active, _checked(tokens), strict=True):
        outputs[i].append(token)


def _checked(tokens: list[int | SamplingError]) -> list[int]:
    for t in tokens:
        if isinstance(t, SamplingError):
            raise t
    return tokens  # type: ignore[return-value]
