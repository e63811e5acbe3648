"""The transports by link kind: each daemon gets its producer and its consumers from the
registry, reads what they can do from their declared capabilities, and a new transport is one
module and one registration line. Real parts: shared-memory pools, a real REGISTER, real NIXL
agents where the wheel is installed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from common.errors import PdkvError
from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.protocol import ErrorCode, MsgType, NixlRegion, Ping, PushFailed, Registered
from common.transfer import Consumer, KVConsumer, KVProducer, Producer, TransferRefused, registry
from common.transfer.nixl_agent import nixl_available
from common.transfer.registry import ConsumerSide, ProducerSettings, Transport

LAYOUT = PoolLayout(
    num_blocks=8, num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32"
)
needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")


IPC = ProducerSettings(event_slots=1)


def _sides(kind: str, settings: ProducerSettings = IPC):  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    transport = registry.transport(kind)
    pool = KVPool.create(LAYOUT)
    producer = transport.producer(pool, BlockAllocator(LAYOUT.num_blocks), settings, loop)
    side = transport.consumer_side(KVPool.create(LAYOUT), loop)
    return transport, producer, side


def test_link_kinds_follow_the_address():
    assert registry.link_kind(None) == registry.UNIX
    assert registry.link_kind("tcp://10.0.0.2:7000") == registry.TCP
    assert set(registry.kinds()) >= {"unix", "tcp"}
    with pytest.raises(PdkvError, match=r"no transport for 'rdma' links \(there are: .*tcp"):
        registry.transport("rdma")


async def test_the_unix_kind_is_the_ipc_pair_and_a_pull_through_it_copies():
    transport, producer, side = _sides("unix")
    try:
        assert isinstance(producer, KVProducer) and transport.same_host
        assert producer.caps.early_handoff and producer.caps.frames == frozenset()
        producer.pool.tensor.copy_(torch.randn(LAYOUT.shape))
        reg, fds = producer.register()
        posted: list[object] = []
        consumer = side.open(reg, lambda n: [os.dup(fd) for fd in fds[:n]], posted.append)
        assert isinstance(consumer, KVConsumer) and consumer.caps.stream_wait
        assert consumer.registered() == Registered(num_blocks=LAYOUT.num_blocks)
        assert consumer.peer_blocks == LAYOUT.num_blocks
        done: list[BaseException | None] = []
        assert consumer.pull([1, 2], [5, 6], -1, done.append) is None  # CPU: readable now
        assert done == [None] and posted == []
        assert torch.equal(consumer.local.tensor[[5, 6]], producer.pool.tensor[[1, 2]])
        # no frames of its own: every frame is the daemon's
        assert not consumer.handle_frame(PushFailed(tag=1, message="x"), posted.append)
        assert not producer.handle_frame(Ping(seq=1), posted.append, "link-1")
        producer.connected(Registered(num_blocks=LAYOUT.num_blocks), "link-1")  # a no-op
        await consumer.drain()
        consumer.close()
    finally:
        side.close()
        producer.close()


async def test_a_nixl_register_on_the_unix_kind_is_refused():
    _, producer, side = _sides("unix")
    try:
        reg, _ = producer.register()
        nixl = NixlRegion(
            agent="a",
            metadata="00",
            addr=0,
            nbytes=1,
            device_id=0,
            mem_type="DRAM",
            transfer="push",
        )
        with pytest.raises(TransferRefused, match="NIXL REGISTER on a Unix-socket link") as info:
            side.open(msgspec.structs.replace(reg, nixl=nixl), lambda n: [], lambda m: None)
        assert info.value.code == ErrorCode.BAD_REQUEST
    finally:
        side.close()
        producer.close()


@needs_nixl
async def test_the_tcp_kind_is_the_nixl_pair_and_declares_what_it_lacks():
    transport, producer, side = _sides("tcp", ProducerSettings(transfer="push"))
    try:
        assert not transport.same_host
        transport.check()
        caps = producer.caps
        assert caps.early_handoff and caps.frames == frozenset({MsgType.PUSH})  # v11
        reg, fds = producer.register()
        assert fds == [] and reg.nixl is not None
        consumer = side.open(reg, lambda n: [], lambda m: None)
        assert not consumer.caps.stream_wait and consumer.caps.early_handoff
        assert consumer.caps.frames == frozenset({MsgType.PUSH_FAILED})
        ok = consumer.registered()  # a push link names the decode's pool
        assert ok.nixl is not None and ok.nixl.agent == side.name
        assert not consumer.handle_frame(Ping(seq=1), lambda m: None)
        await consumer.drain()
        consumer.close()
    finally:
        side.close()
        producer.close()


def test_without_nixl_the_unix_kind_runs_and_the_tcp_kind_says_what_to_install(tmp_path: Path):
    fake = tmp_path / "nonixl" / "nixl_cu13"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed here')\n")
    script = (
        "from common.transfer import registry\n"
        "registry.transport('unix')\n"
        "print('unix ok')\n"
        "registry.transport('tcp').check()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), os.getcwd()])}
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.stdout.strip() == "unix ok"
    assert res.returncode != 0 and "pip install 'pdkv[nixl]'" in res.stderr


class EchoSide(ConsumerSide):
    def open(self, reg, take_fds, post):  # type: ignore[no-untyped-def]
        raise TransferRefused(ErrorCode.INCOMPATIBLE, "echo links move no KV")


class EchoTransport(Transport):
    """A transport defined here, registered with one line by the test below."""

    kind = "echo"
    same_host = True

    def producer(self, pool, allocator, settings, loop):  # type: ignore[no-untyped-def]
        return KVProducer(pool, allocator, "shm", event_slots=0)

    def consumer_side(self, pool, loop):  # type: ignore[no-untyped-def]
        return EchoSide()


async def test_a_transport_is_one_module_and_one_registration_line(monkeypatch):
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))
    monkeypatch.setattr(registry, "_loaded", dict(registry._loaded))
    registry.register("echo", __name__, "EchoTransport")
    transport = registry.transport("echo")
    assert isinstance(transport, EchoTransport) and registry.transport("echo") is transport
    assert "echo" in registry.kinds()
    with pytest.raises(PdkvError, match="registered already"):
        registry.register("echo", __name__, "EchoSide")
    registry.register("wrong", __name__, "EchoSide")  # not a Transport: refused when asked for
    with pytest.raises(PdkvError, match="is not a Transport"):
        registry.transport("wrong")
    _, producer, side = _sides("echo")
    with pytest.raises(TransferRefused, match="echo links"):
        side.open(producer.register()[0], lambda n: [], lambda m: None)
    producer.close()


def test_a_side_that_misses_a_verb_cannot_be_built():
    class Half(Producer):
        def close(self) -> None:
            pass

    with pytest.raises(TypeError, match="register"):
        Half(KVPool.create(LAYOUT), BlockAllocator(LAYOUT.num_blocks))  # type: ignore[abstract]

    class NoDrain(Consumer):
        kind = "x"  # type: ignore[assignment]

    with pytest.raises(TypeError, match="drain"):
        NoDrain()  # type: ignore[abstract]
