"""The "tcp" link kind: the NIXL pair (NixlProducer, NixlConsumer) for daemons on two hosts.

The decode's side is its one NixlAgent, the pool registered once for every TCP link; `check`
is the startup test that NIXL imports (PdkvError saying what to install).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool
from common.protocol import Message, Register
from common.transfer.nixl_agent import NixlAgent, load_nixl
from common.transfer.nixl_consumer import NixlConsumer
from common.transfer.nixl_producer import NixlProducer
from common.transfer.registry import ConsumerSide, ProducerSettings, TakeFds, Transport


class NixlConsumers(ConsumerSide):
    def __init__(self, pool: KVPool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.agent = NixlAgent("decode", pool.tensor, loop)
        self.name = self.agent.name

    def open(
        self, reg: Register, take_fds: TakeFds, post: Callable[[Message], None]
    ) -> NixlConsumer:
        return NixlConsumer.open(reg, self.pool, self.agent, post)

    def close(self) -> None:
        self.agent.close()


class NixlTransport(Transport):
    kind = "tcp"
    same_host = False

    def check(self) -> None:
        load_nixl()

    def producer(
        self,
        pool: KVPool,
        allocator: BlockAllocator,
        settings: ProducerSettings,
        loop: asyncio.AbstractEventLoop,
    ) -> NixlProducer:
        return NixlProducer(pool, allocator, transfer=settings.transfer, loop=loop)

    def consumer_side(self, pool: KVPool, loop: asyncio.AbstractEventLoop) -> NixlConsumers:
        return NixlConsumers(pool, loop)


__all__ = ["NixlConsumers", "NixlTransport"]
