"""The transfer layer as a library, in the shape of LLM-DataDist's cache manager: a thin facade
over the daemons' own transfer objects. The user's guide, with a two-process example, is
docs/library.md.

    mgr = CacheManager()
    cache = mgr.register_blocks_cache(KVPool.create(layout))     # owner side
    payload, fds = mgr.export_cache(cache)                       # send both to the peer, once
    peer_cache = mgr.import_cache(payload, fds)                  # peer side, opened once
    mgr.pull_blocks(peer_cache, my_cache, src_ids, dst_ids)      # read the peer's blocks
    mgr.push_blocks(my_cache, peer_cache, src_ids, dst_ids)      # write into the peer's blocks
    task = mgr.transfer_cache_async(src, dst, src_ids, dst_ids, layer_sync)
    task.synchronize()                                           # layer by layer, paced
    names = mgr.block_names(my_cache, tokens)                    # cache keys of full blocks
    mgr.name_blocks(my_cache, block_ids, names)                  # their KV is written there
    mgr.lookup_blocks(my_cache, names)                           # the longest cached run

A cache is *local* (this process owns the memory: registered) or *remote* (imported from a peer's
export: the same memory, mapped here). Blocks caches are KVPools (block-major, one block's K and V
for all layers contiguous); plain caches are any shareable tensor moved whole.

A blocks cache travels exactly as the daemons' pool does: exporting it builds a KVProducer over
it (the pool exported once, its REGISTER frame and fds are the payload), importing it opens a
KVConsumer from that REGISTER (the consumer's checks, refusals and fd rules), and a pull is the
consumer's pull, through `KVPool.copy_blocks_from` like every copy. A payload from a prefill
daemon's producer imports here, and an export from here opens in a bare KVConsumer. Nothing here
touches a socket: how payload and fds travel is the caller's choice (common.ipc.fdpass, or the
daemons' FrameChannel).

Cache keys, as LLM-DataDist's: a local blocks cache can name the blocks holding a token sequence's
full blocks by the prefix cache's names (common.kv.blockhash: chained over the tokens, seeded with
the `model` given at registration and the pool's dtype and layout, so they equal a prefill
daemon's names for the same model and layout) and find them again by name. The names are an
index only: the caller allocates and writes the blocks, and unnames a block before reusing it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import msgspec
import torch

from common.errors import IpcError, PdkvError
from common.ipc.base import RegionDescriptor, SharedRegion
from common.kv.allocator import BlockAllocator
from common.kv.block_names import BlockNames
from common.kv.blockhash import block_names, hash_seed
from common.kv.blockids import check_block_ids
from common.kv.pool import KVPool, PoolLayout
from common.protocol import encode
from common.protocol.version import MAGIC
from common.transfer import KVConsumer, KVProducer
from common.transfer.cache_links import open_link as _open_link
from common.transfer.cache_links import pull as _pull
from common.transfer.layerwise import LayerSynchronizer, TransferTask, start_layerwise
from common.transfer.regions import close_fds, default_backend, export_region, open_region

_ids = itertools.count(1)


class PlainExport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an owner sends a peer so it can import a plain cache (once). JSON; fds beside it.
    (A blocks cache's export is the daemons' REGISTER frame instead.)"""

    region: RegionDescriptor


@dataclass(eq=False)
class Cache:
    """A registered (local) or imported (remote) cache. `layout` is None for a plain cache.
    A local blocks cache gets its `producer` when first exported; a remote one holds the
    `consumer` that opened it (`pool` is then the consumer's view of the peer's pool)."""

    cache_id: int
    tensor: torch.Tensor
    layout: PoolLayout | None
    remote: bool
    region: SharedRegion | None = None  # a plain cache's, once exported or imported
    pool: KVPool | None = field(default=None, repr=False)
    producer: KVProducer | None = field(default=None, repr=False)
    consumer: KVConsumer | None = field(default=None, repr=False)
    names: BlockNames | None = field(default=None, repr=False)  # a local blocks cache's keys
    seed: bytes = b""  # the root of its block names
    unregistered: bool = False  # by CacheManager.unregister_cache: no transfer may use it

    def blocks(self) -> KVPool:
        self.check_registered()
        if self.pool is None:
            raise IpcError(f"cache {self.cache_id} is a plain cache, not a blocks cache")
        return self.pool

    def check_registered(self) -> None:
        """IpcError if the cache was unregistered (an imported one is unmapped by then)."""
        if self.unregistered:
            raise IpcError(
                f"cache {self.cache_id} was unregistered; register or import it again to use it"
            )


class CacheManager:
    """Registers caches, shares them once, moves blocks between them. Not thread-safe."""

    def __init__(self) -> None:
        self._caches: dict[int, Cache] = {}

    # ---- registration ----------------------------------------------------------------------------
    def register_blocks_cache(self, pool: KVPool, *, model: str = "") -> Cache:
        """A local blocks cache over `pool` (on CPU its tensor must live in shm: KVPool.create).
        `model` identifies the model whose KV it holds (a daemon's model fingerprint): it seeds
        the cache's block names."""
        cache = Cache(next(_ids), pool.tensor, pool.layout, remote=False, pool=pool)
        cache.names = BlockNames(pool.num_blocks)
        layout = pool.layout
        cache.seed = hash_seed(
            model=model, dtype=layout.dtype, block_size=layout.block_size, layout=layout.to_wire()
        )
        return self._add(cache)

    def register_cache(self, tensor: torch.Tensor) -> Cache:
        """A local plain cache (moved whole by pull_cache/push_cache)."""
        return self._add(Cache(next(_ids), tensor, None, remote=False))

    def unregister_cache(self, cache: Cache) -> None:
        """Forget a cache: an exported one is no longer shared (its producer closes), an imported
        one is unmapped (its consumer closes; drop your views of it first). Idempotent."""
        self._caches.pop(cache.cache_id, None)
        cache.unregistered = True
        if cache.producer is not None:
            cache.producer.close()
            cache.producer = None
        if cache.remote:
            cache.pool = None
            cache.tensor = torch.empty(0)
        if cache.consumer is not None:
            cache.consumer.close()
        if cache.region is not None:
            cache.region.close()

    def close(self) -> None:
        for cache in list(self._caches.values()):
            self.unregister_cache(cache)

    def _add(self, cache: Cache) -> Cache:
        self._caches[cache.cache_id] = cache
        return cache

    # ---- sharing ---------------------------------------------------------------------------------
    def export_cache(self, cache: Cache) -> tuple[bytes, list[int]]:
        """(payload, fds) a peer passes to import_cache; the fds stay owned here. Export once per
        peer, not per transfer. A blocks cache's payload is the REGISTER frame of the KVProducer
        built over it on the first export (the pool is exported once per process)."""
        cache.check_registered()  # a new producer here would outlive close()
        if cache.remote:
            raise IpcError(f"cache {cache.cache_id} is imported; only its owner can export it")
        if cache.pool is None:
            if cache.region is None:
                cache.region = export_region(cache.tensor)
            return msgspec.json.encode(PlainExport(region=cache.region.desc)), cache.region.fds()
        if cache.producer is None:
            pool = cache.pool
            allocator = BlockAllocator(pool.num_blocks)  # leases, if an owner wants them
            cache.producer = KVProducer(
                pool, allocator, default_backend(pool.device), event_slots=1
            )
        reg, fds = cache.producer.register()
        return encode(reg), fds

    def import_cache(
        self, payload: bytes, fds: list[int], *, device: torch.device | str = "cpu"
    ) -> Cache:
        """Map a peer's exported cache; the fds are taken over (closed here if it is refused).
        `device`: where this process reads it from (a peer GPU's pool is mapped in this GPU's
        context for the copy kernel). A blocks cache is opened by a KVConsumer: TransferRefused
        with its ERROR code when the payload is not a REGISTER the consumer can honour."""
        device = torch.device(device)
        if payload[: len(MAGIC)] == MAGIC:
            consumer = _open_link(payload, fds, device)
            peer = consumer.peer
            assert peer is not None  # just opened
            cache = Cache(next(_ids), peer.tensor, peer.layout, remote=True, pool=peer)
            cache.consumer = consumer
            return self._add(cache)
        try:
            exp = msgspec.json.decode(payload, type=PlainExport)
        except msgspec.DecodeError as exc:
            close_fds(fds)
            raise IpcError(f"not a cache export: {exc}") from None
        region = open_region(exp.region, fds, device)
        return self._add(Cache(next(_ids), region.to_tensor(), None, remote=True, region=region))

    # ---- cache keys: blocks named by the prefix cache's hashes ------------------------------------
    def block_names(self, cache: Cache, tokens: list[int]) -> list[bytes]:
        """The names of the full blocks of `tokens` in a local blocks cache's layout."""
        _keys(cache)
        return block_names(tokens, cache.blocks().layout.block_size, cache.seed)

    def name_blocks(self, cache: Cache, block_ids: list[int], names: list[bytes]) -> int:
        """Name block_ids[i] names[i] (their KV written); return how many got the name. A name
        already on another block stays there (one copy is found by lookup)."""
        keys = _keys(cache)
        if len(block_ids) != len(names):
            raise IpcError(f"{len(block_ids)} block ids but {len(names)} names")
        check_block_ids(block_ids, cache.blocks().num_blocks, "block", distinct=True)
        named = 0
        for block, name in zip(block_ids, names, strict=True):
            if keys.name_of(block) != name:
                keys.unname(block)
                named += keys.name(block, name)
        return named

    def lookup_blocks(self, cache: Cache, names: list[bytes]) -> list[int]:
        """The blocks named names[0], names[1], ... up to the first name not found."""
        return _keys(cache).lookup(names)

    def unname_blocks(self, cache: Cache, block_ids: list[int]) -> None:
        """Forget the names of blocks whose KV is about to be overwritten."""
        keys = _keys(cache)
        check_block_ids(block_ids, cache.blocks().num_blocks, "block")
        for block in block_ids:
            keys.unname(block)

    # ---- transfers -------------------------------------------------------------------------------
    def pull_blocks(self, src: Cache, dst: Cache, src_ids: list[int], dst_ids: list[int]) -> None:
        """Copy src's blocks src_ids into dst's dst_ids (dst local); complete on return. From a
        remote cache, this is its consumer's pull into dst."""
        _need(not dst.remote, "pull_blocks writes a local cache: dst must be registered here")
        src.blocks()  # a plain cache has no blocks to pull
        if src.consumer is None:
            _copy_blocks(src, dst, src_ids, dst_ids)
            return
        _pull(src.consumer.into(dst.blocks()), src_ids, dst_ids)

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
        return start_layerwise(src.blocks(), dst.blocks(), src_ids, dst_ids, layer_sync, timeout_s)


def _keys(cache: Cache) -> BlockNames:
    if cache.names is None:
        raise IpcError(f"cache {cache.cache_id} has no block names: only a local blocks cache does")
    return cache.names


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise PdkvError(message)


def _copy_blocks(src: Cache, dst: Cache, src_ids: list[int], dst_ids: list[int]) -> None:
    d_pool = dst.blocks()
    d_pool.copy_blocks_from(src.blocks(), src_ids, dst_ids)
    if d_pool.device.type == "cuda":
        torch.cuda.current_stream(d_pool.device).synchronize()


def _copy_whole(src: Cache, dst: Cache) -> None:
    src.check_registered()
    dst.check_registered()
    if src.tensor.shape != dst.tensor.shape or src.tensor.dtype != dst.tensor.dtype:
        raise IpcError(
            f"cannot copy a {tuple(src.tensor.shape)} {src.tensor.dtype} cache into a "
            f"{tuple(dst.tensor.shape)} {dst.tensor.dtype} one"
        )
    dst.tensor.copy_(src.tensor)
    if dst.tensor.device.type == "cuda":
        torch.cuda.current_stream(dst.tensor.device).synchronize()


__all__ = ["Cache", "CacheManager", "LayerSynchronizer", "PlainExport", "TransferTask"]
