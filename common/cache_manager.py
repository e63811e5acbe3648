"""The transfer layer as a library, in the shape of LLM-DataDist's cache manager.

The daemons are its first users in spirit; an engine can use it directly:

    mgr = CacheManager()
    cache = mgr.register_blocks_cache(KVPool.create(layout))     # owner side
    payload, fds = mgr.export_cache(cache)                       # send both to the peer, once
    peer_cache = mgr.import_cache(payload, fds)                  # peer side, opened once
    mgr.pull_blocks(peer_cache, my_cache, src_ids, dst_ids)      # read the peer's blocks
    mgr.push_blocks(my_cache, peer_cache, src_ids, dst_ids)      # write into the peer's blocks
    task = mgr.transfer_cache_async(src, dst, src_ids, dst_ids, layer_sync)
    task.synchronize()                                           # layer by layer, paced

A cache is *local* (this process owns the memory: registered) or *remote* (imported from a peer's
export: the same memory, mapped here). Blocks caches are KVPools (block-major, one block's K and V
for all layers contiguous); plain caches are any shareable tensor moved whole. Every copy goes
through the same pieces as the daemons: KVPool.copy_blocks_from (runs of adjacent blocks on CPU,
the block-copy kernel on CUDA) and the SharedRegion backends (shm, cuda-raw, cuda-torch). Nothing
here touches a socket: how payload and fds travel is the caller's choice (common.ipc.fdpass, or the
daemons' FrameChannel).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import torch

from common.blockids import block_id_array
from common.errors import IpcError, PdkvError
from common.ipc.base import RegionDescriptor, SharedRegion
from common.kvpool import KVPool, PoolLayout
from common.transfer.regions import export_region, open_region

_ids = itertools.count(1)


class CacheExport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an owner sends a peer so it can import a cache (once). JSON; fds travel beside it."""

    region: RegionDescriptor
    layout: dict[str, int | str] | None = None  # None: a plain cache


@dataclass(eq=False)
class Cache:
    """A registered (local) or imported (remote) cache. `layout` is None for a plain cache."""

    cache_id: int
    tensor: torch.Tensor
    layout: PoolLayout | None
    remote: bool
    region: SharedRegion | None = None
    pool: KVPool | None = field(default=None, repr=False)

    def blocks(self) -> KVPool:
        if self.pool is None:
            raise IpcError(f"cache {self.cache_id} is a plain cache, not a blocks cache")
        return self.pool


class LayerSynchronizer(Protocol):
    """Paces a layer-wise transfer: `synchronize_layer(i)` returns once layer i of the source may
    be read (e.g. the producer's forward pass has written it), False on timeout."""

    def synchronize_layer(self, layer_index: int, timeout_s: float) -> bool: ...


class TransferTask:
    """A transfer running in the background; `synchronize()` waits and re-raises its error."""

    def __init__(self, run) -> None:  # type: ignore[no-untyped-def]
        self._error: BaseException | None = None
        self.layers_done = 0

        def body() -> None:
            try:
                run(self)
            except BaseException as exc:  # handed to synchronize()
                self._error = exc

        self._thread = threading.Thread(target=body, name="pdkv-transfer", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Block until the transfer ends; TimeoutError if it is still running after timeout_s."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"transfer still running after {timeout_s} s")
        if self._error is not None:
            raise self._error


class CacheManager:
    """Registers caches, shares them once, moves blocks between them. Not thread-safe."""

    def __init__(self) -> None:
        self._caches: dict[int, Cache] = {}

    # ---- registration ----------------------------------------------------------------------------
    def register_blocks_cache(self, pool: KVPool) -> Cache:
        """A local blocks cache over `pool` (on CPU its tensor must live in shm: KVPool.create)."""
        return self._add(Cache(next(_ids), pool.tensor, pool.layout, remote=False, pool=pool))

    def register_cache(self, tensor: torch.Tensor) -> Cache:
        """A local plain cache (moved whole by pull_cache/push_cache)."""
        return self._add(Cache(next(_ids), tensor, None, remote=False))

    def unregister_cache(self, cache: Cache) -> None:
        """Forget a cache; an imported one is unmapped (drop your views of it first). Idempotent."""
        self._caches.pop(cache.cache_id, None)
        if cache.region is not None:
            cache.pool = None
            cache.tensor = torch.empty(0)
            cache.region.close()

    def close(self) -> None:
        for cache in list(self._caches.values()):
            self.unregister_cache(cache)

    def _add(self, cache: Cache) -> Cache:
        self._caches[cache.cache_id] = cache
        return cache

    # ---- sharing ---------------------------------------------------------------------------------
    def export_cache(self, cache: Cache) -> tuple[bytes, list[int]]:
        """(payload, fds) a peer passes to import_cache. Export once per peer, not per transfer."""
        if cache.remote:
            raise IpcError(f"cache {cache.cache_id} is imported; only its owner can export it")
        if cache.region is None:
            cache.region = export_region(cache.tensor)
        layout = cache.layout.to_wire() if cache.layout is not None else None
        payload = msgspec.json.encode(CacheExport(region=cache.region.desc, layout=layout))
        return payload, cache.region.fds()

    def import_cache(
        self, payload: bytes, fds: list[int], *, device: torch.device | str = "cpu"
    ) -> Cache:
        """Map a peer's exported cache (the fds are taken over). `device`: where this process
        reads it from (a peer GPU's pool is mapped in this GPU's context for the copy kernel)."""
        try:
            exp = msgspec.json.decode(payload, type=CacheExport)
        except msgspec.DecodeError as exc:
            raise IpcError(f"not a cache export: {exc}") from None
        region = open_region(exp.region, fds, torch.device(device))
        tensor = region.to_tensor()
        layout = PoolLayout.from_wire(exp.layout) if exp.layout is not None else None
        pool = KVPool(layout, tensor) if layout is not None else None
        return self._add(Cache(next(_ids), tensor, layout, remote=True, region=region, pool=pool))

    # ---- transfers -------------------------------------------------------------------------------
    def pull_blocks(self, src: Cache, dst: Cache, src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy src's blocks src_ids into dst's dst_ids (dst local); complete on return."""
        _need(not dst.remote, "pull_blocks writes a local cache: dst must be registered here")
        _copy_blocks(src, dst, src_ids, dst_ids)

    def push_blocks(self, src: Cache, dst: Cache, src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy local src's blocks into a peer's cache dst; complete on return."""
        _need(not src.remote, "push_blocks reads a local cache: src must be registered here")
        _copy_blocks(src, dst, src_ids, dst_ids)

    def pull_cache(self, src: Cache, dst: Cache) -> None:
        """Copy the whole of src into local dst (same shape and dtype); complete on return."""
        _need(not dst.remote, "pull_cache writes a local cache: dst must be registered here")
        _copy_whole(src, dst)

    def push_cache(self, src: Cache, dst: Cache) -> None:
        """Copy the whole of local src into a peer's dst; complete on return."""
        _need(not src.remote, "push_cache reads a local cache: src must be registered here")
        _copy_whole(src, dst)

    def transfer_cache_async(
        self,
        src: Cache,
        dst: Cache,
        src_ids: list[int],
        dst_ids: list[int],
        layer_sync: LayerSynchronizer,
        *,
        timeout_s: float = 30.0,
    ) -> TransferTask:
        """Copy the blocks layer by layer in the background, each layer only once
        `layer_sync.synchronize_layer(i)` allowed it (so a transfer can overlap the producer's
        forward pass). The task's synchronize() re-raises a failure or a synchronizer timeout."""
        s_pool, d_pool = src.blocks(), dst.blocks()
        if s_pool.layout.compat_fields() != d_pool.layout.compat_fields():
            raise IpcError("caches of different layouts cannot exchange blocks")
        s_ids = block_id_array(src_ids, s_pool.num_blocks, "source")
        d_ids = block_id_array(dst_ids, d_pool.num_blocks, "destination")
        if s_ids.size != d_ids.size:
            raise IpcError(f"{s_ids.size} source block ids but {d_ids.size} destination ids")
        s_idx = torch.from_numpy(s_ids).to(s_pool.device)
        d_idx = torch.from_numpy(d_ids).to(d_pool.device)

        def run(task: TransferTask) -> None:
            for layer in range(s_pool.layout.num_layers):
                if not layer_sync.synchronize_layer(layer, timeout_s):
                    raise TimeoutError(f"layer {layer} was not ready within {timeout_s} s")
                picked = s_pool.tensor[:, layer].index_select(0, s_idx)
                d_pool.tensor[:, layer].index_copy_(0, d_idx, picked.to(d_pool.device))
                if d_pool.device.type == "cuda":
                    torch.cuda.current_stream(d_pool.device).synchronize()
                task.layers_done = layer + 1

        return TransferTask(run)


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise PdkvError(message)


def _copy_blocks(src: Cache, dst: Cache, src_ids: list[int], dst_ids: list[int]) -> None:
    d_pool = dst.blocks()
    d_pool.copy_blocks_from(src.blocks(), src_ids, dst_ids)
    if d_pool.device.type == "cuda":
        torch.cuda.current_stream(d_pool.device).synchronize()


def _copy_whole(src: Cache, dst: Cache) -> None:
    if src.tensor.shape != dst.tensor.shape or src.tensor.dtype != dst.tensor.dtype:
        raise IpcError(
            f"cannot copy a {tuple(src.tensor.shape)} {src.tensor.dtype} cache into a "
            f"{tuple(dst.tensor.shape)} {dst.tensor.dtype} one"
        )
    dst.tensor.copy_(src.tensor)
    if dst.tensor.device.type == "cuda":
        torch.cuda.current_stream(dst.tensor.device).synchronize()
