"""CUDA IPC of memory across real processes: both backends, interior views, dtypes, refcounts,
and the exporter's memory coming back after it dies."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from common import cuda
from common.ipc.backends import backend_for
from tests.support import gpu_procs

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float32]


def _random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, device="cuda:0").to(dtype)


@pytest.mark.parametrize("kind", ["cuda-raw", "cuda-torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interior_view_round_trip(spawn, kind: str, dtype: torch.dtype) -> None:
    big = _random((4096, 256), dtype)
    view = big[1000:1500]  # interior: neither the allocation's base nor its end
    region = backend_for(kind).export(view)
    assert region.desc.offset > 0 or kind == "cuda-torch"
    torch.cuda.synchronize()
    out = spawn.Queue()
    child = spawn.Process(
        target=gpu_procs.read_region, args=(gpu_procs.encode(region.desc), out), daemon=True
    )
    child.start()
    dtype_s, shape, data = out.get(timeout=gpu_procs.TIMEOUT)
    child.join(timeout=gpu_procs.TIMEOUT)
    assert child.exitcode == 0
    assert dtype_s == str(dtype) and shape == tuple(view.shape)
    assert data == view.contiguous().view(torch.uint8).cpu().numpy().tobytes()
    region.close()


@pytest.mark.parametrize("kind", ["cuda-raw", "cuda-torch"])
def test_two_imports_close_one(spawn, kind: str) -> None:
    t = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda:0")
    region = backend_for(kind).export(t)
    torch.cuda.synchronize()
    out = spawn.Queue()
    child = spawn.Process(
        target=gpu_procs.two_imports, args=(gpu_procs.encode(region.desc), out), daemon=True
    )
    child.start()
    refs_both, refs_one, refs_none, data = out.get(timeout=gpu_procs.TIMEOUT)
    child.join(timeout=gpu_procs.TIMEOUT)
    assert data == t.cpu().numpy().tobytes()
    if kind == "cuda-raw":
        assert (refs_both, refs_one, refs_none) == (2, 1, 0)
    region.close()


def test_exporter_dies_importer_closes_memory_returns(spawn) -> None:
    nbytes = 2 << 30
    torch.cuda.init()
    free_before, _ = cuda.mem_get_info(0)
    out, cmd = spawn.Queue(), spawn.Queue()
    child = spawn.Process(target=gpu_procs.exporter_then_die, args=(nbytes, out, cmd), daemon=True)
    child.start()
    desc = gpu_procs.decode(out.get(timeout=gpu_procs.TIMEOUT))
    region = backend_for("cuda-raw").open(desc, [])
    assert int(region.to_tensor()[nbytes - 1]) == 5
    cmd.put("die")
    child.join(timeout=gpu_procs.TIMEOUT)
    assert child.exitcode == 0
    # The mapping keeps the memory alive after the exporter died: still readable.
    assert int(region.to_tensor()[0]) == 5
    region.close()
    gc.collect()
    assert cuda.ext().open_allocations() == 0
    free_after = free_before - nbytes
    for _ in range(100):  # the driver frees a dead process's memory asynchronously
        free_after, _ = cuda.mem_get_info(0)
        if free_after >= free_before - (64 << 20):
            break
        time.sleep(0.1)
    assert free_after >= free_before - (64 << 20), (free_before, free_after)
