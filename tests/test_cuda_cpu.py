"""What of the CUDA path can be checked on a machine without a GPU: clean failures, the CPU
siblings of the event ring, and block copy on CPU."""

from __future__ import annotations

import random

import pytest
import torch

from common import cuda
from common.errors import CudaError, IpcError
from common.ipc.backends import backend_for
from common.ipc.base import RegionDescriptor
from common.ipc.events import CpuEventRing, event_ring, imported_event_ring
from common.kv.blockcopy import copy_blocks

pytestmark = pytest.mark.skipif(
    cuda.cuda_available(), reason="checks the no-GPU behaviour; this machine has a GPU"
)


def test_cuda_not_available() -> None:
    assert cuda.cuda_available() is False


@pytest.mark.skipif(not cuda.has_extension(), reason="CUDA extension not built here")
def test_extension_call_raises_cuda_error_with_hint() -> None:
    with pytest.raises(CudaError) as info:
        cuda.device_count()
    message = str(info.value)
    assert "cudaGetDeviceCount" in message
    assert "cudaError" in message
    assert "hint:" in message and "--device cpu" in message


@pytest.mark.skipif(not cuda.has_extension(), reason="CUDA extension not built here")
def test_mem_get_info_raises_cuda_error() -> None:
    with pytest.raises(CudaError, match="hint:"):
        cuda.mem_get_info(0)


@pytest.mark.parametrize("kind", ["cuda-raw", "cuda-torch"])
def test_cuda_backend_refuses_cpu_tensor(kind: str) -> None:
    try:
        backend = backend_for(kind)
    except IpcError as exc:
        assert kind in str(exc)
        return
    with pytest.raises(IpcError, match="CUDA tensors only"):
        backend.export(torch.zeros(4))


@pytest.mark.parametrize("kind", ["cuda-raw", "cuda-torch"])
def test_cuda_backend_open_fails_cleanly(kind: str) -> None:
    backend = backend_for(kind)
    desc = RegionDescriptor(
        kind=kind,
        handle=b"\0" * 64,
        offset=0,
        nbytes=16,
        dtype="bfloat16",
        shape=(8,),
        strides=(1,),
        device_uuid="GPU-00000000-0000-0000-0000-000000000000",
    )
    with pytest.raises(IpcError):
        backend.open(desc, [])


def test_cuda_event_ring_fails_cleanly() -> None:
    # built: the driver call fails with the CUDA error and a hint; not built: the rebuild hint
    expected = "hint:" if cuda.has_extension() else "not built"
    with pytest.raises(CudaError, match=expected):
        event_ring(4, "cuda:0")


def test_cpu_event_ring_slots() -> None:
    ring = event_ring(3, "cpu")
    assert isinstance(ring, CpuEventRing)
    assert ring.handles() == [b"", b"", b""]
    slots = [ring.acquire() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2]
    assert ring.acquire() is None
    for slot in slots:
        ring.record(slot)
    ring.release(slots[1])
    assert ring.acquire() == slots[1]
    with pytest.raises(IpcError, match="not in flight"):
        ring.release(7)
    ring.release(slots[0])
    with pytest.raises(IpcError, match="not acquired"):
        ring.record(slots[0])
    peer = imported_event_ring(ring.handles(), "cpu")
    assert len(peer) == 3
    peer.wait(2)
    with pytest.raises(IpcError, match="out of range"):
        peer.wait(3)
    peer.close()
    ring.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_blockcopy_cpu_matches_gather(dtype: torch.dtype) -> None:
    rng = random.Random(7)
    for _ in range(20):
        n_src, n_dst = rng.randint(1, 40), rng.randint(1, 40)
        block = (rng.randint(1, 3), rng.randint(1, 5), 4)
        src = torch.randn((n_src, *block)).to(dtype) if dtype.is_floating_point else None
        if src is None:
            src = torch.randint(0, 256, (n_src, *block), dtype=dtype)
        dst = torch.full((n_dst, *block), 7).to(dtype)
        k = rng.randint(0, min(n_src, n_dst))
        src_ids = rng.sample(range(n_src), k)
        dst_ids = rng.sample(range(n_dst), k)
        expected = dst.clone()
        for s, d in zip(src_ids, dst_ids, strict=True):
            expected[d] = src[s]
        copy_blocks(dst, src, dst_ids, src_ids)
        assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


def test_blockcopy_refuses_mismatch() -> None:
    with pytest.raises(IpcError, match="pools differ"):
        copy_blocks(torch.zeros(4, 8), torch.zeros(4, 9), [0], [0])
    with pytest.raises(IpcError, match="out of range"):
        copy_blocks(torch.zeros(4, 8), torch.zeros(4, 8), [4], [0])
    with pytest.raises(IpcError, match="dst ids"):
        copy_blocks(torch.zeros(4, 8), torch.zeros(4, 8), [0, 1], [0])
