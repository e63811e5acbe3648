"""The block copy kernel equals torch's gather, on one GPU and from a peer GPU's imported pool."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from common.errors import CudaError
from common.ipc.events import EventRing
from common.kv.blockcopy import copy_blocks, copy_ids_cuda

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


def test_kernel_over_many_launches_and_ids_consumed_at_once() -> None:
    """More ids than one launch's parameters hold (480): the copy is split into launches, all on
    the caller's stream; the id arrays may be reused as soon as the call returns."""
    n = 1300
    src = torch.arange(n * 8, device="cuda:0", dtype=torch.float32).view(n, 8)
    dst = torch.zeros_like(src)
    src_ids = np.random.default_rng(5).permutation(n)
    dst_ids = np.arange(n, dtype=np.int64)
    stream = torch.cuda.Stream(0)
    stream.wait_stream(torch.cuda.current_stream(0))
    copy_ids_cuda(dst, src, src_ids, dst_ids, stream)
    src_ids_before = src_ids.copy()
    src_ids[:] = 0  # the launches hold their own copy of the ids
    stream.synchronize()
    assert torch.equal(dst, src[torch.from_numpy(src_ids_before).cuda()])


def test_kernel_refuses_bad_ids() -> None:
    src = torch.zeros((4, 8), device="cuda:0")
    with pytest.raises(CudaError, match="one length"):
        copy_ids_cuda(src.clone(), src, [0, 1], [0], None)
    with pytest.raises(CudaError, match="out of"):
        copy_ids_cuda(src.clone(), src, [0, -1], [0, 1], None)


def test_event_ring_acquire_exhausts() -> None:
    ring = EventRing.create(2, 0)
    a, b = ring.acquire(), ring.acquire()
    assert {a, b} == {0, 1} and ring.acquire() is None
    assert len(ring.handles()) == 2 and all(len(h) == 64 for h in ring.handles())
    ring.release(a)
    assert ring.acquire() == a
    ring.close()
    ring.close()


def test_a_planned_pull_launches_the_same_copy_later() -> None:
    """KVPool.plan_kernel_copy checks and prepares now, KernelCopy.launch only enqueues: the
    blocks equal those copy_blocks_from gives, and what the kernel cannot take plans None."""
    from common.kv.pool import KVPool, PoolLayout

    layout = PoolLayout(
        num_blocks=64, num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16"
    )
    src, dst, want = (KVPool.create(layout, "cuda:0") for _ in range(3))
    src.tensor.normal_()
    src_ids, dst_ids = (
        random.Random(5).sample(range(64), 20),
        random.Random(6).sample(range(64), 20),
    )
    plan = dst.plan_kernel_copy(src, src_ids, dst_ids)
    assert plan is not None
    src_ids.clear()  # the plan holds its own copy of the ids
    stream = torch.cuda.Stream(0)
    plan.launch(stream)
    want.copy_blocks_from(src, random.Random(5).sample(range(64), 20), dst_ids, stream)
    stream.synchronize()
    assert torch.equal(dst.tensor.view(torch.uint8), want.tensor.view(torch.uint8))
    assert dst.plan_kernel_copy(dst, [1], [2]) is None  # one pool: the snapshot path
    cpu = KVPool.create(layout)
    assert cpu.plan_kernel_copy(KVPool.create(layout), [1], [2]) is None
    with pytest.raises(Exception, match="repeat"):
        dst.plan_kernel_copy(src, [1, 2], [3, 3])
