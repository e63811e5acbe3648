"""The block copy kernel equals torch's gather, on one GPU and from a peer GPU's imported pool."""

from __future__ import annotations

import random

import gpu_procs
import pytest
import torch

from common.blockcopy import copy_blocks
from common.ipc.events import EventRing

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("block", "dtype"),
    [((16, 2, 8, 128), torch.bfloat16), ((3, 5), torch.uint8), ((7, 16), torch.float32)],
    ids=["kv-bf16", "odd-bytes", "fp32"],
)
def test_kernel_equals_torch_gather(block: tuple[int, ...], dtype: torch.dtype) -> None:
    rng = random.Random(11)
    for _ in range(5):
        n_src, n_dst = rng.randint(8, 300), rng.randint(8, 300)
        src = torch.randn((n_src, *block), device="cuda:0").to(dtype)
        dst = torch.full((n_dst, *block), 9, device="cuda:0").to(dtype)
        k = rng.randint(1, min(n_src, n_dst))
        src_ids, dst_ids = rng.sample(range(n_src), k), rng.sample(range(n_dst), k)
        expected = dst.clone()
        expected[torch.tensor(dst_ids, device="cuda:0")] = src[
            torch.tensor(src_ids, device="cuda:0")
        ]
        stream = torch.cuda.Stream(0)
        copy_blocks(dst, src, dst_ids, src_ids, stream=stream)
        stream.synchronize()
        assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


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
    region, ring = gpu_procs.open_ring(raw_desc, handles, 1)
    src = region.to_tensor().view(-1, 1024)  # 4096 blocks of 4 KiB on GPU0
    assert src.device.index == 0
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


def test_event_ring_acquire_exhausts() -> None:
    ring = EventRing.create(2, 0)
    a, b = ring.acquire(), ring.acquire()
    assert {a, b} == {0, 1} and ring.acquire() is None
    assert len(ring.handles()) == 2 and all(len(h) == 64 for h in ring.handles())
    ring.release(a)
    assert ring.acquire() == a
    ring.close()
    ring.close()
