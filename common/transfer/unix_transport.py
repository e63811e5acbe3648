"""The "unix" link kind: the IPC pair (KVProducer, KVConsumer) for two daemons on one host.

The decode's side holds the one pull stream every link's pulls run on (CUDA; none on CPU, where
a pull is a copy on the loop thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool
from common.protocol import Message, Register
from common.transfer.consumer import KVConsumer
from common.transfer.producer import KVProducer
from common.transfer.registry import ConsumerSide, ProducerSettings, TakeFds, Transport


class UnixConsumers(ConsumerSide):
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.stream: torch.cuda.Stream | None = None
        if pool.device.type == "cuda":
            torch.cuda.set_device(pool.device)
            self.stream = torch.cuda.Stream(pool.device)
        self.name = "pull-stream" if self.stream is not None else "cpu"

    def open(self, reg: Register, take_fds: TakeFds, post: Callable[[Message], None]) -> KVConsumer:
        return KVConsumer.open(reg, take_fds, self.pool, self.stream)


class UnixTransport(Transport):
    kind = "unix"
    same_host = True

    def producer(
        self,
        pool: KVPool,
        allocator: BlockAllocator,
        settings: ProducerSettings,
        loop: asyncio.AbstractEventLoop,
    ) -> KVProducer:
        return KVProducer(
            pool,
            allocator,
            settings.backend,
            event_slots=settings.event_slots,
            mailbox=settings.mailbox,
        )

    def consumer_side(self, pool: KVPool, loop: asyncio.AbstractEventLoop) -> UnixConsumers:
        return UnixConsumers(pool)


__all__ = ["UnixConsumers", "UnixTransport"]
