"""The library API against a real second process that owns the caches: shm on CPU, and CUDA IPC
on a GPU (gpu marker, run on the device machine); and, in one process, that it is the daemons'
transfer (the KVProducer's REGISTER payload, the KVConsumer's checks and fd rules)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import pytest
import torch

from common.cuda import cuda_available
from common.errors import IpcError, PdkvError
from common.ipc.fdpass import recv_with_fds
from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.protocol import ErrorCode, decode, encode
from common.transfer import KVConsumer, KVProducer, TransferRefused
from common.transfer.cache_manager import Cache, CacheManager

LAYOUT = PoolLayout(
    num_blocks=16, num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32"
)

# The owner: registers a blocks cache (block b, layer l holds 100*b + l) and a plain cache
# (arange), exports both once, then answers "check" requests about its own memory.
OWNER = """
import json, socket, sys, torch
from common.transfer.cache_manager import Cache, CacheManager
from common.cuda import cuda_available
from common.ipc.fdpass import send_with_fds
from common.ipc.shm import shm_empty
from common.kv.pool import KVPool, PoolLayout
sock = socket.socket(fileno=int(sys.argv[1]))
layout = PoolLayout.from_wire(json.loads(sys.argv[2]))
device = sys.argv[3]
mgr = CacheManager()
pool = KVPool.create(layout, device)
for b in range(layout.num_blocks):
    for l in range(layout.num_layers):
        pool.tensor[b, l] = 100 * b + l
plain = shm_empty((64,), torch.float32) if device == "cpu" else torch.zeros(64, device=device)
plain.copy_(torch.arange(64, dtype=torch.float32))
for cache in (mgr.register_blocks_cache(pool), mgr.register_cache(plain)):
    payload, fds = mgr.export_cache(cache)
    send_with_fds(sock, payload, fds)
while True:
    cmd = json.loads(sock.recv(4096))
    if cmd["op"] == "exit":
        break
    if cmd["op"] == "block":
        reply = [float(pool.tensor[cmd["id"], l].mean()) for l in range(layout.num_layers)]
    else:
        reply = plain.tolist()
    sock.send(json.dumps(reply).encode())
"""


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param(
            "cuda:0",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable"),
            ],
        ),
    ],
)
def owner(request):  # one owner process per device: each test uses its own blocks
    device = request.param
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(child.fileno()), json.dumps(LAYOUT.to_wire()), device],
        pass_fds=[child.fileno()],
    )
    child.close()
    parent.settimeout(60)
    mgr = CacheManager()
    caches = []
    for _ in range(2):
        payload, fds = recv_with_fds(parent, 65536, 4)
        caches.append(mgr.import_cache(payload, fds, device=device))

    def ask(**cmd):
        parent.send(json.dumps(cmd).encode())
        return json.loads(parent.recv(65536))

    yield Owner(mgr, caches[0], caches[1], ask, device)
    mgr.close()
    parent.send(b'{"op": "exit"}')
    assert proc.wait(timeout=30) == 0
    parent.close()


@dataclass
class Owner:
    mgr: CacheManager
    remote_blocks: Cache
    remote_plain: Cache
    ask: Callable[..., list[float]]
    device: str

    def local_pool(self) -> Cache:
        return self.mgr.register_blocks_cache(KVPool.create(LAYOUT, self.device))

    def local_plain(self, value: float, n: int = 64) -> Cache:
        return self.mgr.register_cache(torch.full((n,), value, device=self.device))


def _layer_values(pool: KVPool, block: int) -> list[float]:
    return [float(pool.tensor[block, layer].mean()) for layer in range(LAYOUT.num_layers)]


def test_pull_and_push_blocks_and_whole_caches(owner):
    mgr, remote_blocks, remote_plain, ask = (
        owner.mgr,
        owner.remote_blocks,
        owner.remote_plain,
        owner.ask,
    )
    local = owner.local_pool()
    mgr.pull_blocks(remote_blocks, local, [3, 4, 5, 9], [0, 1, 2, 7])
    assert _layer_values(local.blocks(), 0) == [300, 301, 302]
    assert _layer_values(local.blocks(), 7) == [900, 901, 902]
    assert _layer_values(local.blocks(), 3) == [0, 0, 0]  # untouched

    mgr.push_blocks(local, remote_blocks, [0, 7], [15, 14])  # write into the owner's memory
    assert ask(op="block", id=15) == [300, 301, 302]
    assert ask(op="block", id=14) == [900, 901, 902]

    local_plain = owner.local_plain(0.0)
    mgr.pull_cache(remote_plain, local_plain)
    assert local_plain.tensor.tolist() == list(range(64))
    mgr.push_cache(owner.local_plain(7.0), remote_plain)
    assert ask(op="plain") == [7.0] * 64


def test_directions_and_shapes_are_checked(owner):
    mgr, remote_blocks, remote_plain = owner.mgr, owner.remote_blocks, owner.remote_plain
    local = owner.local_pool()
    with pytest.raises(PdkvError, match="dst must be registered here"):
        mgr.pull_blocks(local, remote_blocks, [0], [0])
    with pytest.raises(PdkvError, match="src must be registered here"):
        mgr.push_blocks(remote_blocks, local, [0], [0])
    with pytest.raises(IpcError, match="plain cache"):
        mgr.pull_blocks(remote_plain, local, [0], [0])
    with pytest.raises(IpcError, match="cannot copy a"):
        mgr.pull_cache(remote_plain, owner.local_plain(0.0, n=8))
    with pytest.raises(IpcError, match="out of range"):
        mgr.pull_blocks(remote_blocks, local, [16], [0])
    with pytest.raises(IpcError, match="only its owner"):
        mgr.export_cache(remote_blocks)


class Gate:
    """A layer synchronizer the test opens layer by layer."""

    def __init__(self, layers: int) -> None:
        self.open = [threading.Event() for _ in range(layers)]
        self.asked: list[int] = []

    def synchronize_layer(self, layer_index: int, timeout_s: float) -> bool:
        self.asked.append(layer_index)
        return self.open[layer_index].wait(timeout_s)


def _wait(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_transfer_cache_async_copies_layer_by_layer_as_the_synchronizer_allows(owner):
    mgr, remote_blocks = owner.mgr, owner.remote_blocks
    local = owner.local_pool()
    gate = Gate(LAYOUT.num_layers)
    task = mgr.transfer_cache_async(remote_blocks, local, [2, 6], [10, 11], gate)
    _wait(lambda: gate.asked)  # at layer 0's gate: nothing copied before it
    assert gate.asked == [0]
    assert task.layers_done == 0 and _layer_values(local.blocks(), 10) == [0, 0, 0]
    gate.open[0].set()
    _wait(lambda: task.layers_done == 1 and len(gate.asked) == 2)  # at layer 1's gate
    assert gate.asked == [0, 1] and _layer_values(local.blocks(), 10) == [200, 0, 0]
    gate.open[1].set()
    gate.open[2].set()
    task.synchronize(10)
    assert task.done and gate.asked == [0, 1, 2]
    assert _layer_values(local.blocks(), 10) == [200, 201, 202]
    assert _layer_values(local.blocks(), 11) == [600, 601, 602]


def test_transfer_cache_async_reports_a_synchronizer_timeout(owner):
    mgr, remote_blocks = owner.mgr, owner.remote_blocks
    local = owner.local_pool()
    gate = Gate(LAYOUT.num_layers)
    gate.open[0].set()
    task = mgr.transfer_cache_async(remote_blocks, local, [1], [1], gate, timeout_s=0.2)
    with pytest.raises(TimeoutError, match="layer 1 was not ready"):
        task.synchronize(10)
    assert task.layers_done == 1


# ---- the facade is the daemons' transfer: KVProducer's payload, KVConsumer's rules ------------------


def _filled_pool() -> KVPool:
    pool = KVPool.create(LAYOUT)
    for b in range(LAYOUT.num_blocks):
        pool.tensor[b] = b
    return pool


def test_an_export_is_the_producers_register_and_opens_in_a_bare_consumer():
    mgr = CacheManager()
    owned = mgr.register_blocks_cache(_filled_pool())
    payload, fds = mgr.export_cache(owned)
    assert isinstance(owned.producer, KVProducer)
    assert decode(payload) == owned.producer.register()[0]  # the frame a prefill daemon sends
    consumer = KVConsumer.open(decode(payload), lambda n: [os.dup(fd) for fd in fds[:n]], _local())
    done: list[BaseException | None] = []
    consumer.pull([5, 9], [0, 1], -1, done.append)
    assert done == [None] and consumer.local.tensor[1].unique().tolist() == [9]
    consumer.close()
    mgr.close()


def test_a_daemon_producers_register_imports_and_pulls_through_its_consumer():
    pool = _filled_pool()
    producer = KVProducer(pool, BlockAllocator(LAYOUT.num_blocks), "shm", event_slots=1)
    reg, fds = producer.register()
    mgr = CacheManager()
    remote = mgr.import_cache(encode(reg), [os.dup(fd) for fd in fds])
    assert isinstance(remote.consumer, KVConsumer)
    local = mgr.register_blocks_cache(_local())
    mgr.pull_blocks(remote, local, [3, 7], [7, 3])
    assert local.blocks().tensor[7].unique().tolist() == [3]
    assert local.blocks().tensor[3].unique().tolist() == [7]
    other = PoolLayout(**{**LAYOUT.to_wire(), "block_size": 8})
    with pytest.raises(IpcError, match="different layouts"):  # the consumer's check
        mgr.pull_blocks(remote, mgr.register_blocks_cache(KVPool.create(other)), [0], [0])
    mgr.close()
    assert remote.consumer.peer is None  # unregistering closed the link's mapping
    producer.close()


def _local() -> KVPool:
    return KVPool.create(LAYOUT)


@pytest.mark.parametrize(
    ("edit", "code", "reason"),
    [
        (lambda reg: encode(reg)[:-3], ErrorCode.BAD_REQUEST, "not a cache export"),
        (  # a CPU link has no event ring: the frame is the signal
            lambda reg: encode(
                msgspec.structs.replace(
                    reg, event_count=1, event_handle_size=4, event_handles=b"evnt"
                )
            ),
            ErrorCode.BAD_REQUEST,
            "event handles on a CPU link",
        ),
        (  # a backend this process does not have
            lambda reg: encode(
                msgspec.structs.replace(
                    reg, regions=[msgspec.structs.replace(reg.regions[0], kind="nixl")]
                )
            ),
            ErrorCode.INCOMPATIBLE,
            "nixl",
        ),
    ],
)
def test_a_refused_import_answers_the_consumers_error_and_closes_every_fd(edit, code, reason):
    mgr = CacheManager()
    owned = mgr.register_blocks_cache(_local())
    payload, fds = mgr.export_cache(owned)
    mine = [os.dup(fd) for fd in fds]
    with pytest.raises(TransferRefused, match=reason) as info:
        mgr.import_cache(edit(decode(payload)), mine)
    assert info.value.code == code
    for fd in mine:  # every one closed
        with pytest.raises(OSError):
            os.fstat(fd)
    mgr.close()


def test_an_unregistered_cache_is_refused_by_name():
    mgr = CacheManager()
    owned = mgr.register_blocks_cache(_local())
    payload, fds = mgr.export_cache(owned)
    remote = mgr.import_cache(payload, [os.dup(fd) for fd in fds])
    local = mgr.register_blocks_cache(_local())
    plain = mgr.register_cache(torch.zeros(4))
    for cache in (remote, owned, plain):
        mgr.unregister_cache(cache)
        mgr.unregister_cache(cache)  # idempotent
    with pytest.raises(IpcError, match=f"cache {remote.cache_id} was unregistered"):
        mgr.pull_blocks(remote, local, [0], [0])
    with pytest.raises(IpcError, match="was unregistered"):
        mgr.push_blocks(local, remote, [0], [0])
    with pytest.raises(IpcError, match="was unregistered"):
        mgr.export_cache(owned)
    with pytest.raises(IpcError, match="was unregistered"):
        mgr.push_cache(plain, mgr.register_cache(torch.zeros(4)))
    mgr.close()
