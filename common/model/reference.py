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
