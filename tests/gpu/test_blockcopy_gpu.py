"""The block copy kernel equals torch's gather, on one GPU and from a peer GPU's imported pool."""

from __future__ import annotations

import random

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


def test_event_ring_acquire_exhausts() -> None:
    ring = EventRing.create(2, 0)
    a, b = ring.acquire(), ring.acquire()
    assert {a, b} == {0, 1} and ring.acquire() is None
    assert len(ring.handles()) == 2 and all(len(h) == 64 for h in ring.handles())
    ring.release(a)
    assert ring.acquire() == a
    ring.close()
    ring.close()
