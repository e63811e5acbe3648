"""What both NIXL transfer sides share: the transfer modes, the push notification, byte runs.

Blocks move in runs of adjacent blocks (adjacent in both pools), one NIXL descriptor per run, as
they are one memcpy on one host (`common.kv.pool.block_runs`).
"""

from __future__ import annotations

from common.errors import PdkvError
from common.kv.pool import PoolLayout, block_runs
from common.protocol import NixlRegion

#: pull: the decode READs; push: the prefill WRITEs (the default: see nixl_consumer).
TRANSFERS = ("push", "pull")


def push_tag(tag: int) -> bytes:
    """The notification a push's WRITE carries, which the decode awaits."""
    return b"pdkv-push:%d" % tag


def byte_runs(
    src_ids: list[int], dst_ids: list[int], block_nbytes: int, src_addr: int, dst_addr: int
) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes) of each run of blocks adjacent in both."""
    return [
        (src_addr + s * block_nbytes, dst_addr + d * block_nbytes, n * block_nbytes)
        for s, d, n in block_runs(src_ids, dst_ids)
    ]


def check_region(region: NixlRegion, layout: PoolLayout, whose: str) -> None:
    """A peer's NixlRegion must span exactly its pool of `layout`."""
    if region.nbytes != layout.nbytes:
        raise PdkvError(
            f"{whose} NIXL region is {region.nbytes} bytes, its pool layout needs {layout.nbytes}"
        )


__all__ = ["TRANSFERS", "byte_runs", "check_region", "push_tag"]
