"""The model side of a daemon: device, model, tokenizer, KV pool, allocator and the torch thread.

Torch work runs on one dedicated thread (`ModelRuntime.run`), never on the event loop, so a long
forward pass does not freeze link traffic or other clients; one thread keeps every kernel launch in
order on the daemon's stream and needs no locking around the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch

from common import kernel_cache
from common.allocator import BlockAllocator
from common.config import DaemonConfig
from common.errors import PdkvError
from common.kvpool import KVPool, PoolLayout
from common.model.loader import load_model, resolve_dtype
from common.model.paged import blocks_for
from common.prefix_cache import PrefixCache
from common.protocol import ModelCard, compat_fields, fingerprint
from common.sched import default_slice
from common.throughput import Throughput
from common.transfer.regions import default_backend

log = structlog.get_logger(__name__)
T = TypeVar("T")


def resolve_device(name: str) -> torch.device:
    """`auto` → cuda:0 when CUDA works, else cpu; an unusable cuda:N is a clear error."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise PdkvError(f"--device {name}: expected auto, cpu or cuda:N") from None
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PdkvError(f"--device {name}: CUDA is not available here; use --device cpu")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise PdkvError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) visible")
    elif dev.type != "cpu":
        raise PdkvError(f"--device {name}: expected auto, cpu or cuda:N")
    return dev


def resolve_backend(name: str, device: torch.device) -> str:
    if device.type == "cpu":
        if name not in ("auto", "shm"):
            raise PdkvError(f"--ipc-backend {name} needs a CUDA device; the CPU pool uses shm")
        return "shm"
    if name == "auto":
        return default_backend(device)
    if name not in ("cuda-raw", "cuda-torch"):
        raise PdkvError(f"--ipc-backend {name}: a CUDA pool uses cuda-raw or cuda-torch")
    return name


def _capture_runner(
    model: Any, kv: torch.Tensor, stream: Any, max_batch: int, max_blocks: int
) -> Any:
    """Build the decode daemon's CUDA-graph runner (on the torch thread, on its stream): one
    graph per batch bucket, compiled and captured now, and the sampler's kernels run once
    (common.model.warmup)."""
    from common.model.runner import DecodeRunner
    from common.model.warmup import warm_sampling

    start = time.perf_counter()
    with torch.cuda.stream(stream):
        runner = DecodeRunner(model, kv, max_batch=max_batch, max_blocks=max_blocks)
        runner.capture()
        warm_sampling(runner.run([1], [0], [-1], [[0]])[1])
        stream.synchronize()
    log.info(
        "kernels_warmed",
        role="decode",
        shapes=len(runner.buckets) + 1,
        graphs=runner.buckets,
        max_blocks=max_blocks,
        seconds=round(time.perf_counter() - start, 3),
    )
    return runner


def _warm_prefill(model: Any, kv: torch.Tensor, stream: Any, budget: int, max_prompt: int) -> None:
    """Run the prefill's kernels once per shape class before serving (torch thread, its
    stream; common.model.warmup), so that no request waits for Triton to compile them or for
    a GEMM kernel's first load: the prefill's forwards, then the paged-context ones of a prefix
    cache hit or a chunk (`warm_context`), then the sampler. Measured without it: a fresh
    prefill daemon's first forward of several prompts took 0.9 s instead of 0.05 s. Nothing is
    written into the pool."""
    from common.model import warmup

    buckets = warmup.prefill_token_buckets(budget, max_prompt)
    groups = warmup.prefill_groups(buckets, budget, max_prompt)
    contexts = warmup.context_groups(kv.shape[3])
    start = time.perf_counter()
    with torch.cuda.stream(stream):
        logits = warmup.warm_prefill(model, kv, groups)
        warmup.warm_context(model, kv, contexts)
        warmup.warm_sampling(logits)
        stream.synchronize()
    log.info(
        "kernels_warmed",
        role="prefill",
        shapes=len(groups) + len(contexts) + 1,
        token_buckets=buckets,
        seconds=round(time.perf_counter() - start, 3),
    )


def _capture_prefill_graphs(
    model: Any, kv: torch.Tensor, stream: Any, max_tokens: int, max_blocks: int
) -> Any:
    """The prefill's CUDA graphs (common.model.prefill_graphs), captured on the torch thread and
    its stream after the kernels are warm."""
    from common.model.prefill_graphs import PrefillGraphs

    start = time.perf_counter()
    with torch.cuda.stream(stream):
        graphs = PrefillGraphs(model, kv, max_tokens=max_tokens, max_seqs=8, max_blocks=max_blocks)
        count = graphs.capture()
    log.info(
        "prefill_graphs_captured",
        graphs=count,
        token_buckets=graphs.tokens,
        seq_buckets=graphs.seqs,
        seconds=round(time.perf_counter() - start, 3),
    )
    return graphs


TINY_NAME = "pdkv-tiny"


def model_card(model_dir: str | None, max_positions: int) -> ModelCard:
    """The card of the checkpoint in `model_dir` (None: the built-in tiny model)."""
    if model_dir is None:
        return ModelCard(name=TINY_NAME, max_positions=max_positions)
    path = Path(model_dir).resolve()
    return ModelCard(name=path.name, path=str(path), max_positions=max_positions)


@dataclass
class ModelRuntime:
    model: Any
    tokenizer: Any
    device: torch.device
    layout: PoolLayout
    pool: KVPool
    allocator: BlockAllocator
    backend: str
    fingerprint: str
    executor: ThreadPoolExecutor
    stream: Any = None  # the daemon's own CUDA stream (torch thread); None on CPU
    runner: Any = None  # the decode daemon's DecodeRunner (CUDA graphs); None on CPU / prefill
    card: ModelCard | None = None  # the model as clients see it (STATUS_REPLY)
    prefix: PrefixCache | None = None  # the prefix cache over `allocator` (load() makes it)
    prefill_graphs: Any = None  # the prefill daemon's PrefillGraphs; None on CPU / decode / off

    @property
    def compat(self) -> dict[str, Any]:
        """What the fingerprint hashes, in the clear (sent in HELLO, compared by the decode)."""
        return compat_fields(
            model_id=self.model.fingerprint, layout=self.layout.to_wire(), backend=self.backend
        )

    @classmethod
    def load(cls, cfg: DaemonConfig, role: str) -> ModelRuntime:
        kernels = kernel_cache.configure(cfg.kernel_cache_dir)  # before anything imports triton
        device = resolve_device(cfg.device)
        backend = resolve_backend(cfg.ipc_backend, device)
        default = "float32" if device.type == "cpu" else "bfloat16"
        dtype = resolve_dtype(cfg.dtype or default, device, tiny=cfg.model is None)
        dtype_name = str(dtype).removeprefix("torch.")  # bf16 and bfloat16 fingerprint alike
        threads = cfg.torch_threads or (1 if cfg.model is None else 0)
        if threads:
            torch.set_num_threads(threads)
        model, tokenizer = load_model(
            cfg.model, device=device, dtype=dtype, allow_byte_tokenizer=cfg.allow_byte_tokenizer
        )
        layers, kv_heads, head_dim = model.kv_layout_args()
        layout = PoolLayout(
            num_blocks=cfg.num_blocks,
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=cfg.block_size,
            dtype=dtype_name,
        )
        pool = KVPool.create(layout, device=device)
        fp = fingerprint(model_id=model.fingerprint, layout=layout.to_wire(), backend=backend)
        executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"pdkv-{role}-torch", initializer=default_slice
        )
        stream = prefill_graphs = None
        # the widest block table a sequence can have: the graphs' static tables are this wide
        max_blocks = min(
            blocks_for(model.config.max_position_embeddings, cfg.block_size), cfg.num_blocks
        )
        if device.type == "cuda":
            executor.submit(torch.cuda.set_device, device).result()
            stream = executor.submit(torch.cuda.Stream, device).result()
        if role == "prefill" and stream is not None and model.use_kernels:
            budget = cfg.prefill_budget(device.type)  # type: ignore[attr-defined]
            longest = min(cfg.max_prompt_tokens, model.config.max_position_embeddings)
            executor.submit(_warm_prefill, model, pool.tensor, stream, budget, longest).result()
            graph_tokens = cfg.prefill_graph_tokens  # type: ignore[attr-defined]
            if graph_tokens:
                args = (model, pool.tensor, stream, min(graph_tokens, budget), max_blocks)
                prefill_graphs = executor.submit(_capture_prefill_graphs, *args).result()
        runner = None
        if role == "decode" and stream is not None and model.use_kernels:
            args = (model, pool.tensor, stream, cfg.max_batch, max_blocks)
            runner = executor.submit(_capture_runner, *args).result()
        log.info("kernel_cache", **kernels)
        log.info(
            "model_loaded",
            role=role,
            model=model.fingerprint,
            device=str(device),
            dtype=dtype_name,
            backend=backend,
            num_blocks=cfg.num_blocks,
            pool_mib=round(layout.nbytes / 2**20, 1),
        )
        allocator = BlockAllocator(cfg.num_blocks)
        return cls(
            model,
            tokenizer,
            device,
            layout,
            pool,
            allocator,
            backend,
            fp,
            executor,
            stream,
            runner,
            model_card(cfg.model, model.config.max_position_embeddings),
            PrefixCache(allocator, layout, model.fingerprint, cfg.prefix_cache),
            prefill_graphs,
        )

    def on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """Context for torch work on the daemon's own stream (a no-op on CPU)."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Queue `fn` on the torch thread now (from the loop); its result as a future."""
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` on the torch thread without blocking the loop."""
        return await self.submit(fn, *args, **kwargs)

    def pool_stats(self) -> dict[str, int]:
        a = self.allocator
        return {
            "total": a.total,
            "free": a.num_free,  # the cached ones included: an allocation may take them
            "cached": a.num_cached,
            "owned": a.num_owned,
            "leased": a.num_leased,
        }

    def status_fields(self, throughput: Throughput) -> dict[str, Any]:
        """STATUS_REPLY's model, dtype, requests served and tokens/s."""
        return {
            "model": self.model.fingerprint,
            "dtype": self.layout.dtype,
            "served": throughput.served,
            "tokens_per_s": throughput.tokens_per_s(),
            "model_card": self.card,
        }

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
