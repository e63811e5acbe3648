"""The decode daemon's model runtime and its warm-up: the decode step's CUDA graphs, one per
batch bucket, compiled and captured before the first link, and the sampler's kernels run once."""

from __future__ import annotations

import time
from typing import Any

import structlog
import torch

from common.daemon.runtime import ModelRuntime
from decode_server.config import DecodeConfig

log = structlog.get_logger(__name__)


def load_runtime(cfg: DecodeConfig) -> ModelRuntime:
    """The decode's ModelRuntime; on CUDA with the Triton kernels `rt.graphs` is its
    DecodeRunner (common.model.runner). The grammar library's view of the tokenizer is built
    meanwhile on a thread of its own (common.structured.warm)."""
    from common.structured.warm import warm_runtime

    rt = ModelRuntime.load(cfg, "decode", lambda rt, max_blocks: capture(rt, cfg, max_blocks))
    warm_runtime(rt, "decode")
    return rt


def capture(rt: ModelRuntime, cfg: DecodeConfig, max_blocks: int) -> Any:
    """Build the decode's CUDA-graph runner (on the torch thread, on its stream): one graph per
    batch bucket up to --max-batch, compiled and captured now, and the sampler's kernels run
    once (common.model.warmup)."""
    from common.model.runner import DecodeRunner
    from common.model.warmup import warm_sampling

    start = time.perf_counter()
    with torch.cuda.stream(rt.stream):
        runner = DecodeRunner(
            rt.model, rt.pool.tensor, max_batch=cfg.max_batch, max_blocks=max_blocks
        )
        runner.capture()
        warm_sampling(runner.run([1], [0], [-1], [[0]])[1])
        rt.stream.synchronize()
    log.info(
        "kernels_warmed",
        role="decode",
        shapes=len(runner.buckets) + 1,
        graphs=runner.buckets,
        max_blocks=max_blocks,
        seconds=round(time.perf_counter() - start, 3),
    )
    return runner
