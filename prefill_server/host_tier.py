"""The prefill's use of the host KV tier (common/kv/tier_io.py): its prefix lookup goes on past the
pool's cache into the tier, and a prompt's full blocks are written through once computed."""

from __future__ import annotations

import structlog

from common.daemon.runtime import ModelRuntime
from common.kv.tier_io import PoolTier
from prefill_server.request import PrefillRequest

log = structlog.get_logger(__name__)


async def restore(pt: PoolTier, req: PrefillRequest, hit: int) -> int:
    """After the pool's cache gave the prompt's first `hit` blocks: copy the tier's next ones into
    the request's fresh blocks (PoolTier.restore_async: never on the torch thread, so no other
    request's forward waits for it); how many arrived whole. Like the pool's cache, never the
    block holding the last token."""
    limit = (len(req.prompt_tokens) - 1) // pt.block_size
    if limit <= hit:
        return 0
    restored = await pt.restore_async(req.names[hit:limit], req.blocks[hit:limit])
    if restored:
        log.debug("host_tier_restored", request_id=req.request_id, blocks=restored, after=hit)
    return restored


def write_through(rt: ModelRuntime, req: PrefillRequest) -> None:
    """The request's forward wrote its blocks: queue the copy of those it computed into the tier
    on the torch thread (after that forward, before any later one that could reuse them). Those
    it took from the pool's cache or the tier are not copied again: a pool hit was written
    through by the request that computed it (unless the tier evicted it since: then it is
    written again when a request computes it again)."""
    first = req.cached_tokens // rt.layout.block_size  # those came from a cache: stored already
    pairs = list(zip(req.names[first:], req.blocks[first:], strict=False))
    if pairs:
        rt.host_tier.write_later(rt.executor, pairs)
