"""The shm backend and fd passing: real memfds, a real socketpair and a real second process."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import structlog
import torch

from common.errors import IpcError
from common.ipc.backends import backend_for
from common.ipc.base import RegionDescriptor
from common.ipc.fdpass import recv_exact_with_fds, recv_with_fds, send_with_fds
from common.ipc.shm import ShmRegion, is_shm, shm_empty
from common.kv.pool import KVPool, PoolLayout

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60  # seconds for any wait on the child; a failure must not hang the suite

LAYOUT = PoolLayout(
    num_blocks=16, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32"
)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def mappings_of(name: str) -> int:
    """How many mappings of memfd `name` this process has (from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return sum(f"/memfd:{name} " in line for line in maps)


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def numbered(pool: KVPool, offset: float = 0.0) -> KVPool:
    ids = torch.arange(pool.num_blocks, dtype=pool.tensor.dtype) + offset
    pool.tensor.copy_(ids.view(-1, 1, 1, 1, 1, 1).expand_as(pool.tensor))
    return pool


def import_here(region: ShmRegion) -> ShmRegion:
    """Open an exported region in this process (a second, independent mapping of the memfd)."""
    return ShmRegion.open(region.desc, [os.dup(fd) for fd in region.fds()])


# -- shm_empty and export ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_shm_empty_is_zeroed_shared_memory(dtype: torch.dtype) -> None:
    t = shm_empty((3, 5), dtype)
    assert t.shape == (3, 5) and t.dtype is dtype and t.is_contiguous()
    assert is_shm(t) and is_shm(t[1:]) and not t.any()
    assert not is_shm(torch.zeros(3))


def test_shm_empty_zero_size_and_bad_shape() -> None:
    t = shm_empty((0, 4), torch.float32)
    region = ShmRegion.export(t)
    assert region.desc.nbytes == 0
    region.close()
    with pytest.raises(IpcError, match="negative dimension"):
        shm_empty((2, -1), torch.float32)


def test_export_refuses_memory_not_from_shm_empty() -> None:
    with pytest.raises(IpcError, match=r"not in shared memory; allocate it with .*shm_empty"):
        ShmRegion.export(torch.zeros(4, 4))


def test_export_refuses_a_view_with_gaps() -> None:
    t = shm_empty((4, 6), torch.float32)
    with pytest.raises(IpcError, match=r"non-contiguous tensor of shape \(4, 3\)"):
        ShmRegion.export(t[:, ::2])


def test_backend_registered_under_shm() -> None:
    assert backend_for("shm") is ShmRegion


def test_interior_view_round_trip_in_process() -> None:
    pool = numbered(KVPool.create(LAYOUT))
    region = ShmRegion.export(pool.tensor[5:9])
    assert region.desc.offset == 5 * LAYOUT.block_nbytes
    assert region.desc.shape == (4, *LAYOUT.block_shape)
    imported = import_here(region)
    view = imported.to_tensor()
    assert view.data_ptr() != pool.tensor[5].data_ptr()  # a second mapping, same pages
    assert view[:, 0, 0, 0, 0, 0].tolist() == [5, 6, 7, 8]
    view[1].fill_(-1)
    assert pool.tensor[6].eq(-1).all() and pool.tensor[5].eq(5).all()
    del view
    imported.close()
    region.close()


def test_permuted_view_is_shared_as_its_contiguous_permutation() -> None:
    t = shm_empty((2, 3), torch.float32)
    t.copy_(torch.arange(6.0).view(2, 3))
    region = ShmRegion.export(t.t())
    assert region.desc.shape == (2, 3)
    imported = import_here(region)
    assert torch.equal(imported.to_tensor(), t)
    imported.close()
    region.close()


# -- descriptor mismatches and fd ownership ---------------------------------------------------


@pytest.fixture
def exported() -> Iterator[ShmRegion]:
    region = ShmRegion.export(shm_empty((4, 8), torch.float32))
    yield region
    region.close()


def bad_open(region: ShmRegion, match: str, **changes: object) -> None:
    """open() with a tampered descriptor fails with `match` and closes the fd it was given."""
    desc = msgspec.structs.replace(region.desc, **changes)
    fd = os.dup(region.fds()[0])
    with pytest.raises(IpcError, match=match):
        ShmRegion.open(desc, [fd])
    assert not fd_is_open(fd)


def test_open_refuses_a_region_larger_than_the_memfd(exported: ShmRegion) -> None:
    bad_open(
        exported,
        r"holds 128 bytes but the descriptor needs bytes \[0, 256\); wrong fd or descriptor",
        shape=(8, 8),
        strides=(8, 1),
        nbytes=256,
    )
    bad_open(exported, r"needs bytes \[16, 144\)", offset=16)


def test_open_refuses_dtype_and_shape_that_contradict_nbytes(exported: ShmRegion) -> None:
    bad_open(exported, r"nbytes 128 does not match shape \(4, 8\) x float16", dtype="float16")
    bad_open(exported, r"unknown dtype 'float128'", dtype="float128")
    bad_open(exported, r"does not match shape \(4, 4\)", shape=(4, 4), strides=(4, 1))
    bad_open(exported, r"strides \(1, 4\) are not contiguous", strides=(1, 4))
    bad_open(exported, "offset 2 is not a multiple of the float32 item size 4", offset=2)
    bad_open(exported, "of kind 'cuda-raw' given to the shm backend", kind="cuda-raw")


def test_pool_memfd_is_sealed_against_resizing(exported: ShmRegion) -> None:
    """A peer that could shrink the memfd under our mapping would crash us (SIGBUS) on the next
    read of the cut pages; the exporter seals the size and importers insist on it."""
    fd = exported.fds()[0]
    size = os.fstat(fd).st_size
    for new_size in (0, size // 2, size * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, new_size)
    assert os.fstat(fd).st_size == size


def test_open_refuses_an_unsealed_memfd_and_a_plain_file(exported: ShmRegion) -> None:
    size = os.fstat(exported.fds()[0]).st_size
    unsealed = os.memfd_create("pdkv-unsealed")
    os.ftruncate(unsealed, size)
    with pytest.raises(IpcError, match="not sealed against shrinking"):
        ShmRegion.open(exported.desc, [unsealed])
    assert not fd_is_open(unsealed)
    with tempfile.TemporaryFile() as fh:
        fh.truncate(size)
        plain = os.dup(fh.fileno())
        with pytest.raises(IpcError, match="not a sealable memfd"):
            ShmRegion.open(exported.desc, [plain])
        assert not fd_is_open(plain)


def test_open_needs_exactly_one_fd(exported: ShmRegion) -> None:
    with pytest.raises(IpcError, match=r"exactly one fd .* got 0"):
        ShmRegion.open(exported.desc, [])
    fds = [os.dup(exported.fds()[0]), os.dup(exported.fds()[0])]
    with pytest.raises(IpcError, match="got 2"):
        ShmRegion.open(exported.desc, fds)
    assert not any(fd_is_open(fd) for fd in fds)


def test_pool_over_import_checks_the_layout(exported: ShmRegion) -> None:
    imported = import_here(exported)
    with pytest.raises(IpcError, match="layout needs"):
        KVPool(LAYOUT, imported.to_tensor())
    imported.close()


# -- close ----------------------------------------------------------------------------------


def test_close_is_idempotent_and_releases_fds() -> None:
    before = open_fds()
    t = shm_empty((4, 8), torch.float32, name="pdkv-test-close")
    region = ShmRegion.export(t)
    imported = import_here(region)
    imported.to_tensor().fill_(1)
    assert mappings_of("pdkv-test-close") == 2
    [fd] = region.fds()
    imported.close()
    assert mappings_of("pdkv-test-close") == 1  # the import is unmapped at once
    imported.close()
    region.close()
    region.close()
    assert imported.closed and region.closed and region.fds() == []
    assert not fd_is_open(fd)
    with pytest.raises(IpcError, match="closed"):
        imported.to_tensor()
    del t  # the last tensor over the memfd: its mapping and fd go too
    assert open_fds() == before
    assert mappings_of("pdkv-test-close") == 0


def test_close_with_a_live_tensor_logs_and_keeps_the_memory_valid() -> None:
    t = shm_empty((4, 8), torch.float32, name="pdkv-test-deferred")
    t.fill_(3)
    region = ShmRegion.export(t)
    imported = import_here(region)
    alive = imported.to_tensor()
    with structlog.testing.capture_logs() as logs:
        imported.close()
    assert [e["event"] for e in logs] == ["shm_close_deferred"]
    assert "drop tensors" in logs[0]["hint"]
    assert alive.eq(3).all()  # still mapped: unmapped only once `alive` is collected
    alive.fill_(4)
    assert t.eq(4).all()
    assert mappings_of("pdkv-test-deferred") == 2
    del alive
    assert mappings_of("pdkv-test-deferred") == 1
    region.close()


# -- fdpass ---------------------------------------------------------------------------------


def test_fdpass_round_trip_and_too_many_fds_closes_them() -> None:
    a, b = socket.socketpair()
    a.settimeout(TIMEOUT)
    b.settimeout(TIMEOUT)
    with a, b:
        r, w = os.pipe()
        send_with_fds(a, b"x" * 10, [r])
        data, fds = recv_exact_with_fds(b, 10, maxfds=1)
        assert data == b"x" * 10 and len(fds) == 1
        os.write(w, b"hi")
        assert os.read(fds[0], 2) == b"hi"  # the received fd is the same pipe
        os.close(fds[0])
        baseline = open_fds()
        send_with_fds(a, b"y", [r, w, r])
        with pytest.raises(IpcError, match="more file descriptors than the 1 expected"):
            recv_with_fds(b, 16, maxfds=1)
        assert open_fds() == baseline  # nothing received was leaked
        os.close(r)
        os.close(w)
        a.sendall(b"ab")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(IpcError, match="peer closed the socket after 2 of 5 bytes"):
            recv_exact_with_fds(b, 5, maxfds=0)
    with pytest.raises(IpcError, match="at least one byte"):
        send_with_fds(a, b"", [0])


# -- a real second process ------------------------------------------------------------------

CHILD = r"""
import json, socket, struct, sys, traceback
import msgspec, torch
from common.ipc.base import RegionDescriptor
from common.ipc.fdpass import recv_exact_with_fds, send_with_fds
from common.ipc.shm import ShmRegion
from common.kv.pool import KVPool, PoolLayout

sock = socket.socket(fileno=int(sys.argv[1]))
sock.settimeout(60)

def reply(obj):
    body = json.dumps(obj).encode()
    send_with_fds(sock, struct.pack(">I", len(body)) + body, [])

try:
    head, fds = recv_exact_with_fds(sock, 4, maxfds=8)
    body, _ = recv_exact_with_fds(sock, struct.unpack(">I", head)[0], maxfds=0)
    jobs = msgspec.json.decode(body)
    out = []
    for job, fd in zip(jobs, fds, strict=True):
        desc = msgspec.convert(job["desc"], RegionDescriptor)
        region = ShmRegion.open(desc, [fd])
        pool = KVPool(PoolLayout.from_wire(job["layout"]), region.to_tensor())
        seen = pool.tensor.reshape(pool.num_blocks, -1).float()
        assert torch.equal(seen.min(1).values, seen.max(1).values), "a block is not uniform"
        result = {"seen": seen[:, 0].tolist()}
        for block, value in job["write"]:
            pool.tensor[block].fill_(value)
        if job.get("pull"):
            # Pull from the imported pool into a local one, then push it back elsewhere.
            local = KVPool.create(PoolLayout.from_wire({**job["layout"], "num_blocks": 8}))
            src_ids, dst_ids, back_ids = job["pull"]
            local.copy_blocks_from(pool, src_ids, dst_ids)
            result["local"] = local.tensor.reshape(8, -1)[:, 0].float().tolist()
            pool.copy_blocks_from(local, dst_ids, back_ids)
        del pool, seen
        region.close()
        out.append(result)
    reply({"ok": True, "results": out})
except Exception:
    reply({"ok": False, "error": traceback.format_exc()})
"""


@pytest.fixture
def child() -> Iterator[socket.socket]:
    """A fresh python process running CHILD, connected by a socketpair."""
    parent_sock, child_sock = socket.socketpair()
    parent_sock.settimeout(TIMEOUT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(child_sock.fileno())],
        pass_fds=[child_sock.fileno()],
        cwd=ROOT,
        env=env,
    )
    child_sock.close()
    try:
        yield parent_sock
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        parent_sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)


def exchange(sock: socket.socket, jobs: list[dict], regions: list[ShmRegion]) -> list[dict]:
    body = msgspec.json.encode(jobs)
    fds = [fd for r in regions for fd in r.fds()]
    send_with_fds(sock, struct.pack(">I", len(body)) + body, fds)
    head, _ = recv_exact_with_fds(sock, 4, maxfds=0)
    answer = msgspec.json.decode(recv_exact_with_fds(sock, struct.unpack(">I", head)[0], 0)[0])
    assert answer["ok"], answer.get("error")
    return answer["results"]


def test_second_process_reads_and_writes_pools_over_a_unix_socket(child: socket.socket) -> None:
    fp32 = numbered(KVPool.create(LAYOUT), offset=1)
    bf16 = numbered(KVPool.create(PoolLayout(**{**LAYOUT.to_wire(), "dtype": "bfloat16"})))
    regions = [
        ShmRegion.export(fp32.tensor),
        ShmRegion.export(fp32.tensor[4:10]),  # an interior view: offset != 0
        ShmRegion.export(bf16.tensor),
    ]
    assert regions[1].desc.offset == 4 * LAYOUT.block_nbytes
    interior = {**LAYOUT.to_wire(), "num_blocks": 6}
    jobs = [
        {"desc": regions[0].desc, "layout": LAYOUT.to_wire(), "write": [[14, -14], [15, -15]]},
        {"desc": regions[1].desc, "layout": interior, "write": [[0, 100]]},
        {
            "desc": regions[2].desc,
            "layout": bf16.layout.to_wire(),
            "write": [[0, 0.5]],
            "pull": [[3, 4, 5, 9], [0, 1, 2, 7], [12, 13, 14, 15]],
        },
    ]
    results = exchange(child, jobs, regions)

    assert results[0]["seen"] == [b + 1.0 for b in range(16)]
    assert results[1]["seen"] == [b + 1.0 for b in range(4, 10)]
    assert results[2]["seen"] == [float(b) for b in range(16)]
    assert results[2]["local"] == [3, 4, 5, 0, 0, 0, 0, 9]
    values = fp32.tensor.reshape(16, -1)
    assert values[:, 0].tolist() == [1, 2, 3, 4, 100, *range(6, 15), -14, -15]
    assert torch.equal(values.min(1).values, values.max(1).values)
    got = bf16.tensor.reshape(16, -1).float()
    assert got[:, 0].tolist() == [0.5, *range(1, 12), 3, 4, 5, 9]
    assert torch.equal(got.min(1).values, got.max(1).values)
    for region in regions:
        region.close()


def test_local_pool_pulls_from_an_imported_pool() -> None:
    remote = numbered(KVPool.create(LAYOUT), offset=10)
    region = ShmRegion.export(remote.tensor)
    imported = import_here(region)
    peer = KVPool(LAYOUT, imported.to_tensor())
    local = KVPool.create(PoolLayout(**{**LAYOUT.to_wire(), "num_blocks": 4}))
    local.copy_blocks_from(peer, [15, 2, 3], [0, 2, 3])
    assert local.tensor.reshape(4, -1)[:, 0].tolist() == [25, 0, 12, 13]
    del peer
    imported.close()
    region.close()


def test_descriptor_survives_json() -> None:
    region = ShmRegion.export(shm_empty((2, 3), torch.bfloat16)[1:])
    wire = msgspec.json.encode(region.desc)
    assert msgspec.json.decode(wire, type=RegionDescriptor) == region.desc
    region.close()
