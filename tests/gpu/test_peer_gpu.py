"""Cross-GPU pull: a decode on GPU1 waits on a GPU0 prefill's event and pulls blocks from its
imported pool with the block copy kernel (runs last: a fault here must not poison other tests)."""

from __future__ import annotations

import random

import gpu_procs
import pytest
import torch

from common.blockcopy import copy_blocks
from common.ipc.cuda_raw import CudaRawRegion
from common.ipc.events import imported_event_ring

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
