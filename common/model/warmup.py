"""Every kernel shape class the serving path meets, run once at a daemon's start (CUDA with the
Triton kernels), so that no request waits for a compile or a first kernel load (issue 24, item 4).

The classes, and where each comes from:
- decode: one CUDA graph per batch bucket, `batch_buckets(max_batch)` (below) — the list
  `DecodeRunner.bucket_for` picks from, captured (and so compiled) by `DecodeRunner.capture`;
  the block-table width is fixed per runner (`max_blocks`), so the decode attention's split
  count is one class;
- prefill: a forward of one prompt alone (torch's flash attention) and of several (the varlen
  kernel), at every token bucket of `prefill_token_buckets`: powers of two from 16 up to the
  most tokens one forward can hold — the batcher's budget, or one prompt as long as the daemon
  accepts — since cuBLAS picks its GEMM kernels by the token count and loads each on first use;
  counts that are and are not multiples of 16 (Triton specializes integer arguments on that);
- prefill after a context (a prefix cache hit, a chunk of a long prompt: the paged-context
  kernel), `context_groups`: one prompt and two after one cached block, with block tables whose
  width is and is not a multiple of 16 (the table's row stride is specialized the same way); its
  GEMMs are the prefill's, warmed above;
- sampling: a greedy and a random row (temperature, top-k, top-p, a seeded generator) through
  `sample_batch_isolated` on the device.
The model's head dim, dtype and layer count are fixed per daemon, so they add no class.

On CPU the daemons run torch's path, whose kernels need no compiling: nothing is warmed there
(with TRITON_INTERPRET=1 the kernels run interpreted and a warm-up would take minutes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from common.model.sampling import make_generator, sample_batch_isolated
from common.sampling_params import SamplingParams

MIN_BUCKET = 16


def batch_buckets(max_batch: int) -> list[int]:
    """The decode's graph batch sizes (DecodeRunner captures one graph each and replays the
    smallest that holds a batch): powers of two up to 16, then every 16 (then 32 past 128)."""
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_batch]
    b = 16
    while b < max_batch:
        b += 16 if b < 128 else 32
        sizes.append(min(b, max_batch))
    return sorted({*sizes, max_batch})


#: the prefill's graph buckets double up to here, then grow by a quarter of a power of two
GRAPH_FINE_FROM = 1024


def graph_token_buckets(max_tokens: int) -> list[int]:
    """The prefill's CUDA-graph token buckets (PrefillGraphs captures one graph per bucket and
    prompt count, and replays the smallest that holds a forward): 16, 32, ... doubling up to
    1,024, where a forward costs the host's ~200 launches more than its tokens; then 1,280,
    1,536, 1,792, 2,048, 2,560, ... a quarter of the power of two below at a time, where its GPU
    time grows with its tokens and a padded row costs what a real one does (at most 25 % more
    rows than the forward's). Up to and including the first bucket >= `max_tokens`."""
    out = [MIN_BUCKET]
    while out[-1] < max_tokens:
        b = out[-1]
        out.append(2 * b if b < GRAPH_FINE_FROM else b + (1 << (b.bit_length() - 1)) // 4)
    return out


def prefill_token_buckets(budget: int, max_prompt: int) -> list[int]:
    """Token counts warmed for the prefill: 16, 32, ... doubling below the largest forward the
    batcher can run, and its two limits: `budget` (a batch of prompts is at most that many
    tokens) and `max_prompt` (a prompt alone is at most that long)."""
    largest = max(budget, max_prompt, 1)
    powers, n = [], MIN_BUCKET
    while n < largest:
        powers.append(n)
        n *= 2
    return sorted({*powers, max(budget, 1), max(max_prompt, 1)})


def bucket_of(tokens: int, buckets: Sequence[int]) -> int:
    """The bucket a forward of `tokens` tokens falls in: the smallest that holds it."""
    return next(b for b in buckets if b >= tokens)


def prefill_groups(buckets: Sequence[int], budget: int, longest: int) -> list[list[int]]:
    """The prompt lengths of each warm-up forward, per bucket n: one prompt of n tokens and one
    of n - 1 (not a multiple of 16) where a prompt may be that long (`longest`), and where the
    budget lets prompts share a forward, a varlen batch of n tokens in all (as few prompts as
    `longest` allows, at least two)."""
    groups = []
    for n in buckets:
        groups += [[m] for m in (n, n - 1) if 1 <= m <= longest]
        if 2 <= n <= budget:
            parts = max(2, -(-n // longest))
            groups.append([n // parts + (i < n % parts) for i in range(parts)])
    return groups


def warm_prefill(model: Any, kv: torch.Tensor, groups: Sequence[Sequence[int]]) -> torch.Tensor:
    """Run one prefill forward per group (caller: the torch thread, on the daemon's stream).
    Every slot is -1, so nothing is written into the pool `kv`. Returns the last logits."""
    from common.model.prefill import prefill_many

    logits = torch.empty(0)
    for group in groups:
        prompts = [torch.ones(n, dtype=torch.long) for n in group]
        slots = [torch.full((n,), -1, dtype=torch.long) for n in group]
        logits = prefill_many(model, prompts, slots, kv, token_budget=sum(group))
    return logits


def context_groups(block_size: int) -> list[tuple[list[int], int]]:
    """The paged-context warm-up forwards: (prompt lengths, block-table width) each, every
    prompt starting after one cached block of `block_size` positions."""
    return [(group, width) for width in (2, 16) for group in ([block_size], [block_size, 1])]


def warm_context(
    model: Any, kv: torch.Tensor, groups: Sequence[tuple[Sequence[int], int]]
) -> torch.Tensor:
    """Run one prefill forward after a cached block per group (caller: the torch thread, on the
    daemon's stream), its context read through a block table of the group's width (block 0
    throughout: whatever it holds, the logits are thrown away). Every slot is -1, so nothing is
    written into the pool `kv`. Returns the last logits."""
    block_size = kv.shape[3]
    logits = torch.empty(0)
    for group, width in groups:
        prompts = [torch.ones(n, dtype=torch.long) for n in group]
        slots = [torch.full((n,), -1, dtype=torch.long) for n in group]
        starts, tables = [block_size] * len(group), [[0] * width] * len(group)
        logits = model.prefill_batch(prompts, slots, kv, starts=starts, block_tables=tables)
    return logits


def warm_sampling(logits: torch.Tensor) -> None:
    """A greedy and a random row drawn from `logits` [>=1, vocab] on its device."""
    rows = logits[:1].float().expand(2, -1).contiguous()
    params = [
        SamplingParams(max_tokens=2),
        SamplingParams(max_tokens=2, temperature=0.8, top_k=40, top_p=0.9, seed=1),
    ]
    sample_batch_isolated(rows, params, [make_generator(p, 0) for p in params])


__all__ = [
    "batch_buckets",
    "bucket_of",
    "context_groups",
    "graph_token_buckets",
    "prefill_groups",
    "prefill_token_buckets",
    "warm_context",
    "warm_prefill",
    "warm_sampling",
]
