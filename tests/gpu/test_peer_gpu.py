"""Cross-GPU pull: a decode on GPU1 waits on a GPU0 prefill's event and pulls blocks from its
imported pool with the block copy kernel (runs last: a fault here must not poison other tests)."""

from __future__ import annotations

import random

import pytest
import torch

from common.ipc.cuda_raw import CudaRawRegion
from common.ipc.events import imported_event_ring
from common.kv.blockcopy import copy_blocks
from common.kv.pool import KVPool, PoolLayout
from common.transfer.regions import open_region
from tests.support import gpu_procs

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cross_gpu_pull_from_imported_pool(spawn) -> None:
    out, cmd = spawn.Queue(), spawn.Queue()
    child = spawn.Process(
        target=gpu_procs.prefill_after_spin,
        args=(1 << 22, 7.0, 50_000_000, out, cmd, 0),
        daemon=True,
    )
    child.start()
    raw_desc, handles = out.get(timeout=gpu_procs.TIMEOUT)
    # Decode on GPU1: the event is opened with GPU1 current, the pull runs on a GPU1 stream.
    region = CudaRawRegion.open_on(gpu_procs.decode(raw_desc), 1)  # GPU0 memory, GPU1 mapping
    ring = imported_event_ring(handles, 1)
    src = region.to_tensor().view(-1, 1024)  # 4096 blocks of 4 KiB
    assert src.device.index == 1
    dst = torch.full((512, 1024), -1.0, device="cuda:1")
    cmd.put("go")
    slot = out.get(timeout=gpu_procs.TIMEOUT)
    stream = torch.cuda.Stream(1)
    ring.wait(slot, stream)
    ids = random.Random(3).sample(range(4096), 512)
    copy_blocks(dst, src, list(range(512)), ids, stream=stream)
    stream.synchronize()
    cmd.put("done")
    child.join(timeout=gpu_procs.TIMEOUT)
    assert torch.all(dst == 7.0)
    ring.close()
    region.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cross_gpu_pull_of_a_torch_ipc_pool_is_ordered_after_the_event(spawn) -> None:
    """cuda-torch maps the peer's pool on the exporter's GPU, so the consumer's pull gathers it
    there with torch. That gather must be ordered after the producer's event too, not only the
    copy on the decode GPU's pull stream (it ran on GPU0's current stream, which waited on
    nothing, and read the pool before the prefill wrote it); and the host must not wait."""
    layout = PoolLayout(
        num_blocks=1024, num_layers=1, num_kv_heads=1, head_dim=256, block_size=2, dtype="float32"
    )
    out, cmd = spawn.Queue(), spawn.Queue()
    child = spawn.Process(
        target=gpu_procs.prefill_after_spin,
        args=(layout.nbytes // 4, 7.0, 200_000_000, out, cmd, 0, "cuda-torch"),
        daemon=True,
    )
    child.start()
    raw_desc, handles = out.get(timeout=gpu_procs.TIMEOUT)
    region = open_region(gpu_procs.decode(raw_desc), [], torch.device("cuda:1"))
    peer = KVPool(layout, region.to_tensor().view(layout.shape))
    assert peer.device.index == 0  # mapped on the exporter's GPU: the torch path, not the kernel
    local = KVPool.create(layout, "cuda:1")
    ring = imported_event_ring(handles, 1)
    stream = torch.cuda.Stream(1)
    ids = random.Random(5).sample(range(layout.num_blocks), 256)
    with torch.cuda.stream(stream):  # warm the allocators (device and pinned) on both GPUs
        local.copy_blocks_from(peer, ids, list(range(256)))
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert torch.all(local.tensor[:256] == 0.0)
    cmd.put("go")
    slot = out.get(timeout=gpu_procs.TIMEOUT)
    ring.wait(slot, stream)  # as KVConsumer does: the wait on the decode GPU's pull stream
    with torch.cuda.stream(stream):
        local.copy_blocks_from(peer, ids, list(range(256)))
    copied = torch.cuda.Event()
    copied.record(stream)
    host_went_ahead = not copied.query()  # the producer still spins: nothing waited on the host
    copied.synchronize()
    cmd.put("done")
    child.join(timeout=gpu_procs.TIMEOUT)
    seen = local.tensor[:256]
    assert torch.all(seen == 7.0), f"pulled {seen.unique().tolist()} before the producer's write"
    assert host_went_ahead, "the pull made the host wait for the producer's event"
    ring.close()
    region.close()
