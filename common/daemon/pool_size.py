"""How many KV blocks `--num-blocks auto` gives a daemon: arithmetic only, no device calls
(common.daemon.memory reads the device; ModelRuntime.load applies the result).

    budget = fraction x total              the daemon's share of the device (host memory on CPU)
    pool   = budget - held - reserve       what is left of it for the KV pool
    pool  <= free - reserve - margin       never more than is free now, keeping a margin
    blocks = pool // block bytes

`held` is what the daemon holds once its model is loaded (the weights it pays for: none when it
maps another daemon's with --share-weights); `reserve` is an upper bound on the memory of its
largest forward (`reserve_bytes`), which comes out of the free memory after the pool is made.
Each daemon has its own fraction, as vLLM's --gpu-memory-utilization is per instance: two daemons
on one GPU must together stay below 1, leaving room for what neither counts (CUDA contexts,
cuBLAS workspaces, the allocator's fragmentation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from common.daemon.rundir import StartupError

if TYPE_CHECKING:  # not imported at run time: the CLI reads this module without torch
    from common.model.config import LlamaConfig

AUTO = "auto"
#: memory that must stay free after the pool and the reserve: a share of the total, at least MIN
MARGIN_SHARE = 0.02
MARGIN_MIN = 512 * 2**20
#: CUDA: cuBLAS's workspaces, taken from torch's allocator on first use (32 MiB per stream on
#: Hopper; the daemon's stream and the default one)
CUDA_WORKSPACES = 2 * 32 * 2**20
_INDEX_BYTES = 8 * 6  # int64 per token: ids, positions, slots, their blocks and offsets, rows
_MASK_PAIR_BYTES = 1 + 4  # an explicit attention mask: bool, and the float copy SDPA makes
_FP32 = 4
#: the estimate below counts the tensors a forward holds at its peak; the allocators' rounding
#: and transient copies it misses came to 7-17 % of it on the CPU (tests/test_pool_size.py's
#: measured forwards), so the reserve is a fifth larger
RESERVE_SLACK = 1.2


def parse_num_blocks(text: str) -> int | Literal["auto"]:
    """--num-blocks: a positive count, or `auto` (sized from the device's memory)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"wants a positive number of blocks or auto, got {text!r}")
    return value


class PoolSizeError(StartupError):
    """--num-blocks auto leaves too few blocks: the message names every number and the fix."""


@dataclass(frozen=True)
class Forward:
    """The largest forward a daemon runs, as the memory it needs depends on it.

    `tokens` rows pass through the layers, `logit_rows` of them reach the head and the sampler.
    The torch attention (CPU, or CUDA without the Triton kernels) also materializes
    `mask_pairs` (query, key) pairs of an explicit mask (the prefill over a cached context or a
    window) and `gathered_keys` (row, key) pairs of K/V gathered from the pool (the decode).
    A CUDA graph pool holds the memory of the largest captured forward for the daemon's life:
    `graph_tokens` and `graph_rows` (0: no graphs).
    """

    tokens: int
    logit_rows: int
    mask_pairs: int = 0
    gathered_keys: int = 0
    graph_tokens: int = 0
    graph_rows: int = 0


def token_bytes(c: LlamaConfig, dtype_bytes: int) -> int:
    """Activations per token of one layer, every intermediate counted as live at once (an upper
    bound: a layer's are freed before the next one's): residual, normed input and projection
    output; q/k/v, roped q and k, attention output; gate|up, silu(gate) and the product. In fp32:
    the RMSNorm's copy and result, RoPE's q and k and its rotated halves, cos and sin."""
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    qkv = (c.num_heads + 2 * c.num_kv_heads) * d
    roped = (c.num_heads + c.num_kv_heads) * d
    same = 3 * h + qkv + roped + c.num_heads * d + 4 * i
    return dtype_bytes * same + _FP32 * (2 * h + 2 * roped + 2 * d) + _INDEX_BYTES


def logit_row_bytes(c: LlamaConfig, dtype_bytes: int) -> int:
    """One row of logits: the head's output, its fp32 copy and the sampler's two fp32 temps."""
    return c.vocab_size * (dtype_bytes + 3 * _FP32)


def gathered_key_bytes(c: LlamaConfig, dtype_bytes: int) -> int:
    """One (row, key) of the torch decode attention: K and V gathered, in fp32 and masked, and
    the fp32 scores, their mask and softmax of every query head."""
    kv = 2 * c.num_kv_heads * c.head_dim
    return kv * (dtype_bytes + 2 * _FP32) + c.num_heads * 3 * _FP32


def reserve_bytes(c: LlamaConfig, dtype_bytes: int, f: Forward) -> int:
    """Upper bound on the memory the daemon's largest forward `f` takes while it runs (and its
    graph pool keeps) beside the weights and the pool."""
    tok, row = token_bytes(c, dtype_bytes), logit_row_bytes(c, dtype_bytes)
    return int(
        RESERVE_SLACK
        * (
            f.tokens * tok
            + f.logit_rows * row
            + f.mask_pairs * _MASK_PAIR_BYTES
            + f.gathered_keys * gathered_key_bytes(c, dtype_bytes)
            + f.graph_tokens * tok
            + f.graph_rows * row
        )
    )


def margin_bytes(total: int) -> int:
    """Memory left free after the pool and the reserve (for the other daemon's growth, the
    allocators' slack): MARGIN_SHARE of the total, at least MARGIN_MIN."""
    return max(MARGIN_MIN, int(MARGIN_SHARE * total))


@dataclass(frozen=True)
class PoolPlan:
    """The decision and every number it came from (logged at start, named when refused)."""

    total: int  # the device's memory (bytes)
    free: int  # free now, after loading
    fraction: float
    budget: int  # fraction x total
    held: int
    reserve: int
    margin: int
    block_bytes: int
    blocks: int
    limit: str  # "budget" or "free": which bound gave `blocks`

    def fields(self) -> dict[str, int | float | str]:
        """For the log line: sizes in MiB."""
        mib = {
            k: round(getattr(self, k) / 2**20, 1)
            for k in ("total", "free", "budget", "held", "reserve", "margin")
        }
        return {
            **{f"{k}_mib": v for k, v in mib.items()},
            "fraction": self.fraction,
            "block_bytes": self.block_bytes,
            "blocks": self.blocks,
            "pool_mib": round(self.blocks * self.block_bytes / 2**20, 1),
            "limited_by": self.limit,
        }


def plan(
    *, total: int, free: int, fraction: float, held: int, reserve: int, block_bytes: int
) -> PoolPlan:
    """Blocks for a daemon allowed `fraction` of `total` bytes, holding `held`, needing `reserve`
    for its forwards, with `free` bytes free now (see the module doc). Never negative."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    budget = int(fraction * total)
    margin = margin_bytes(total)
    by_budget = budget - held - reserve
    by_free = free - reserve - margin
    limit = "budget" if by_budget <= by_free else "free"
    blocks = max(0, min(by_budget, by_free)) // block_bytes
    return PoolPlan(
        total, free, fraction, budget, held, reserve, margin, block_bytes, blocks, limit
    )


def check(p: PoolPlan, min_blocks: int, longest: int) -> None:
    """PoolSizeError unless `p` holds at least `min_blocks` (one sequence of `longest` tokens,
    and at least 1): one line naming the numbers and what to change."""
    need = max(1, min_blocks)
    if p.blocks >= need:
        return
    why = (
        f"{p.fraction:g} of {_gib(p.total)} is {_gib(p.budget)}, less {_gib(p.held)} held and "
        f"{_gib(p.reserve)} reserved for the largest forward"
    )
    if p.limit == "free":
        why += (
            f"; only {_gib(p.free)} is free now, less the reserve and a margin of {_gib(p.margin)}"
        )
    raise PoolSizeError(
        f"--num-blocks auto: {why}, leaves {p.blocks} blocks of {p.block_bytes} bytes, but one "
        f"sequence of {longest} tokens needs {need}; raise --memory-fraction (or lower "
        "--max-batch / --max-prefill-tokens / --max-prompt-tokens), free device memory, or give "
        "--num-blocks N"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.3g} MiB"


__all__ = [
    "AUTO",
    "Forward",
    "PoolPlan",
    "PoolSizeError",
    "check",
    "parse_num_blocks",
    "plan",
    "reserve_bytes",
]
