"""The decode side's fixtures: a real tiny-model runtime, a real producer pool in shared memory
opened through a real KVConsumer, fake links that record what the decode posts (their classes:
tests.support.decode), and the request table."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from common.daemon.runtime import ModelRuntime
from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.transfer import KVProducer
from decode_server.config import DecodeConfig
from decode_server.requests import DecodeRequests
from decode_server.startup import load_runtime
from tests.support.decode import DeferredConsumer, FakeLink, Side, open_consumer


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelRuntime]:
    cfg = DecodeConfig(
        runtime_dir=tmp_path_factory.mktemp("rt"), device="cpu", num_blocks=24, block_size=4
    )
    runtime = load_runtime(cfg)
    yield runtime
    runtime.close()


@pytest.fixture
def side(rt: ModelRuntime) -> Iterator[Side]:
    layout = PoolLayout(**{**rt.layout.to_wire(), "num_blocks": 32})
    pool = KVPool.create(layout)
    producer = KVProducer(pool, BlockAllocator(layout.num_blocks), "shm", event_slots=4)
    yield Side(producer, rt)
    producer.close()


@pytest.fixture
def link(side: Side, rt: ModelRuntime) -> Iterator[FakeLink]:
    consumer = open_consumer(side, rt.pool)
    yield FakeLink("link-a", consumer)
    consumer.close()


@pytest.fixture
def dlink(side: Side, rt):  # type: ignore[no-untyped-def]
    reg, fds = side.producer.register()
    consumer = DeferredConsumer.open(
        reg, lambda n: [os.dup(fd) for fd in fds[:n]], rt.pool, stream=object()
    )
    consumer.events = []
    yield FakeLink("link-d", consumer)
    consumer.close()


@pytest.fixture
def table(rt):  # type: ignore[no-untyped-def]
    requests = DecodeRequests(rt, max_batch=8)
    yield requests
    assert rt.allocator.num_free == rt.allocator.total, "a test left decode blocks owned"
