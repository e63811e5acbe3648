"""The model side of a daemon: device, model, tokenizer, KV pool, allocator and the torch thread.

Torch work runs on one dedicated thread (`ModelRuntime.run`), never on the event loop, so a long
forward pass does not freeze link traffic or other clients; one thread keeps every kernel launch in
order on the daemon's stream and needs no locking around the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch

from common.daemon import kernel_cache, memory
from common.daemon.config import DaemonConfig
from common.daemon.pool_size import PoolPlan
from common.daemon.sched import default_slice
from common.daemon.throughput import Throughput
from common.errors import PdkvError
from common.ipc.weights import SharedWeights, WeightsKey, acquire
from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.kv.prefix_cache import PrefixCache
from common.model.loader import ModelSource, resolve_dtype
from common.model.paged import blocks_for
from common.protocol import ModelCard, compat_fields, fingerprint
from common.transfer.regions import default_backend

log = structlog.get_logger(__name__)
T = TypeVar("T")
#: a daemon's warm-up (ModelRuntime.load): (runtime, widest block table) -> its CUDA graphs
Warm = Callable[["ModelRuntime", int], Any]


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
    card: ModelCard | None = None  # the model as clients see it (STATUS_REPLY)
    prefix: PrefixCache | None = None  # the prefix cache over `allocator` (load() makes it)
    #: the daemon's CUDA graphs, made by its warm-up (load's `warm`): the decode's DecodeRunner,
    #: the prefill's PrefillGraphs; None on CPU, without a warm-up or with graphs off
    graphs: Any = None
    #: this daemon's hold on the host's one copy of the weights (--share-weights), else None
    weights: SharedWeights | None = None
    #: the host KV tier's copies to and from `pool` (common/kv/tier_io.py); None: --host-cache-gb 0
    host_tier: Any = None

    @property
    def compat(self) -> dict[str, Any]:
        """What the fingerprint hashes, in the clear (sent in HELLO, compared by the decode)."""
        return compat_fields(
            model_id=self.model.fingerprint, layout=self.layout.to_wire(), backend=self.backend
        )

    @classmethod
    def load(cls, cfg: DaemonConfig, role: str, warm: Warm | None = None) -> ModelRuntime:
        """Load the model and make the pool, allocator, prefix cache and torch thread for the
        daemon named `role` (its thread's and log lines' name). On CUDA with the Triton
        kernels, `warm(rt, max_blocks)` then runs on the torch thread, on the daemon's stream:
        the daemon's own warm-up, whose result (its CUDA graphs, or None) becomes `rt.graphs`.
        `max_blocks` is the widest block table a sequence can have."""
        kernels = kernel_cache.configure(cfg.kernel_cache_dir)  # before anything imports triton
        device = resolve_device(cfg.device)
        backend = resolve_backend(cfg.ipc_backend, device)
        default = "float32" if device.type == "cpu" else "bfloat16"
        dtype = resolve_dtype(cfg.dtype or default, device, tiny=cfg.model is None)
        dtype_name = str(dtype).removeprefix("torch.")  # bf16 and bfloat16 fingerprint alike
        threads = cfg.torch_threads or (1 if cfg.model is None else 0)
        if threads:
            torch.set_num_threads(threads)
        model, tokenizer, weights = load_weights(cfg, device, dtype, backend)
        layers, kv_heads, head_dim = model.kv_layout_args()
        layout = PoolLayout(
            num_blocks=1,
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=cfg.block_size,
            dtype=dtype_name,
        )
        num_blocks, plan = pool_blocks(cfg, model, weights, device, layout.block_nbytes)
        layout = dataclasses.replace(layout, num_blocks=num_blocks)
        pool = KVPool.create(layout, device=device)
        base = memory.peak_start(device) if plan is not None else 0
        fp = fingerprint(model_id=model.fingerprint, layout=layout.to_wire(), backend=backend)
        executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"pdkv-{role}-torch", initializer=default_slice
        )
        stream = None
        if device.type == "cuda":
            executor.submit(torch.cuda.set_device, device).result()
            stream = executor.submit(torch.cuda.Stream, device).result()
        allocator = BlockAllocator(num_blocks)
        rt = cls(
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
            model_card(cfg.model, model.config.max_position_embeddings),
            PrefixCache(allocator, layout, model.fingerprint, cfg.prefix_cache),
            weights=weights,
        )
        rt.host_tier = open_host_tier(cfg, rt)
        if warm is not None and stream is not None and model.use_kernels:
            max_blocks = min(
                blocks_for(model.config.max_position_embeddings, cfg.block_size), num_blocks
            )
            rt.graphs = executor.submit(warm, rt, max_blocks).result()
        if plan is not None:
            memory.log_peak(device, base, plan, role)
        log.info("kernel_cache", **kernels)
        log.info(
            "model_loaded",
            role=role,
            model=model.fingerprint,
            device=str(device),
            dtype=dtype_name,
            backend=backend,
            num_blocks=num_blocks,
            pool_mib=round(layout.nbytes / 2**20, 1),
        )
        return rt

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
        if self.host_tier is not None:
            self.host_tier.close()
        if self.weights is not None:  # after the torch thread: nothing reads them any more
            self.weights.close()


def pool_blocks(
    cfg: DaemonConfig, model: Any, weights: SharedWeights | None, device: torch.device, block: int
) -> tuple[int, PoolPlan | None]:
    """The pool's size in blocks of `block` bytes: --num-blocks, or under auto what the
    device's memory holds (common.daemon.memory), with the plan it came from."""
    if not isinstance(cfg.num_blocks, int):
        plan = memory.auto_pool(cfg, model, weights, device, block)
        return plan.blocks, plan
    if cfg.memory_fraction is not None:
        log.warning("memory_fraction_unused", num_blocks=cfg.num_blocks, hint="--num-blocks auto")
    return cfg.num_blocks, None


def open_host_tier(cfg: DaemonConfig, rt: ModelRuntime) -> Any:
    """The daemon's PoolTier over the host tier (--host-cache-gb), None when off; TierError
    (a startup error: one line, exit 3) when the size holds no block."""
    if not cfg.host_cache_gb:
        return None
    from common.kv.host_tier import HostTier, default_path
    from common.kv.tier_io import PoolTier

    path = cfg.host_cache_path or default_path(cfg.runtime_dir, rt.layout.to_wire())
    tier = HostTier.open(
        path, slot_bytes=rt.layout.block_nbytes, capacity_bytes=int(cfg.host_cache_gb * 2**30)
    )
    seed = rt.prefix.seed if rt.prefix is not None else b""
    return PoolTier(tier, rt.pool, seed, rt.stream)


def load_weights(
    cfg: DaemonConfig, device: torch.device, dtype: torch.dtype, backend: str
) -> tuple[Any, Any, SharedWeights | None]:
    """(model, tokenizer, the shared weights or None): with --share-weights the model's arena
    is the host's one copy for its key (common.ipc.weights), mapped or loaded and served here;
    without, an arena of its own."""
    source = ModelSource.find(cfg.model, device=device, dtype=dtype)
    tokenizer = source.tokenizer(allow_bytes=cfg.allow_byte_tokenizer)  # refused before loading
    if not cfg.shares_weights(device.type):
        arena = source.layout.allocate(device)
        source.fill(arena)
        return source.model(arena), tokenizer, None
    dtype_name = str(dtype).removeprefix("torch.")
    key = WeightsKey(source.fingerprint, dtype_name, _device_key(device), source.files_id)
    shared = acquire(
        cfg.runtime_dir, key, source.layout, device, backend, source.fill, on_lost=_owner_lost
    )
    log.info("weights", role=shared.role, owner_pid=shared.owner_pid, key=key.digest)
    return source.model(shared.arena), tokenizer, shared


def _device_key(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    from common.cuda import device_uuid

    return device_uuid(device.index or 0)


def _owner_lost(owner_pid: int) -> None:
    """A CUDA importer's owner went away: its mapping may be gone with it, so no kernel may read
    it again. Exit now with the status that asks to be restarted (lifecycle.EXIT_FATAL)."""
    from common.daemon.lifecycle import EXIT_FATAL

    log.critical(
        "weights_owner_lost",
        owner_pid=owner_pid,
        exit_code=EXIT_FATAL,
        hint="the daemon whose weights this one mapped exited; restart this one (or start it "
        "with --no-share-weights)",
    )
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(EXIT_FATAL)
