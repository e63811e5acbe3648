"""The prefill daemon's model runtime and its warm-up: every shape class of its forwards run once
(so that no request waits for Triton to compile a kernel or a GEMM's first load), then its CUDA
graphs for small forwards (--prefill-graph-tokens) captured."""

from __future__ import annotations

import time
from typing import Any

import structlog
import torch

from common.daemon.runtime import ModelRuntime
from prefill_server.config import PrefillConfig

log = structlog.get_logger(__name__)


def load_runtime(cfg: PrefillConfig) -> ModelRuntime:
    """The prefill's ModelRuntime, warmed on CUDA; `rt.graphs` is its PrefillGraphs
    (common.model.prefill_graphs), or None with --prefill-graph-tokens 0. The grammar
    library's view of the tokenizer is built meanwhile on a thread of its own
    (common.structured.warm: a constrained request's admission then costs a schema's compile)."""
    from common.structured.warm import warm_runtime

    rt = ModelRuntime.load(cfg, "prefill", lambda rt, max_blocks: warm(rt, cfg, max_blocks))
    warm_runtime(rt, "prefill")
    return rt


def warm(rt: ModelRuntime, cfg: PrefillConfig, max_blocks: int) -> Any:
    """Torch thread, the daemon's stream: the kernels warmed, then the graphs captured."""
    budget = cfg.prefill_budget(rt.device.type)
    longest = min(cfg.max_prompt_tokens, rt.model.config.max_position_embeddings)
    warm_kernels(rt, budget, longest)
    if not cfg.prefill_graph_tokens:
        return None
    return capture_graphs(rt, min(cfg.prefill_graph_tokens, budget), max_blocks)


def warm_kernels(rt: ModelRuntime, budget: int, max_prompt: int) -> None:
    """Run the prefill's kernels once per shape class before serving (common.model.warmup): the
    forwards, then the paged-context ones of a prefix cache hit or a chunk (`warm_context`),
    then the sampler. Measured without it: a fresh prefill daemon's first forward of several
    prompts took 0.9 s instead of 0.05 s. Nothing is written into the pool."""
    from common.model import warmup

    kv = rt.pool.tensor
    buckets = warmup.prefill_token_buckets(budget, max_prompt)
    groups = warmup.prefill_groups(buckets, budget, max_prompt)
    contexts = warmup.context_groups(kv.shape[3])
    start = time.perf_counter()
    with torch.cuda.stream(rt.stream):
        logits = warmup.warm_prefill(rt.model, kv, groups)
        warmup.warm_context(rt.model, kv, contexts)
        warmup.warm_sampling(logits)
        rt.stream.synchronize()
    log.info(
        "kernels_warmed",
        role="prefill",
        shapes=len(groups) + len(contexts) + 1,
        token_buckets=buckets,
        seconds=round(time.perf_counter() - start, 3),
    )


def capture_graphs(rt: ModelRuntime, max_tokens: int, max_blocks: int) -> Any:
    """The prefill's CUDA graphs, captured after the kernels are warm."""
    from common.model.prefill_graphs import PrefillGraphs

    start = time.perf_counter()
    with torch.cuda.stream(rt.stream):
        graphs = PrefillGraphs(
            rt.model, rt.pool.tensor, max_tokens=max_tokens, max_seqs=8, max_blocks=max_blocks
        )
        count = graphs.capture()
    log.info(
        "prefill_graphs_captured",
        graphs=count,
        token_buckets=graphs.tokens,
        seq_buckets=graphs.seqs,
        seconds=round(time.perf_counter() - start, 3),
    )
    return graphs
