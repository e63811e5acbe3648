"""The decode step's inputs on the CUDA-graph path (DecodeEngine._inputs, BlockTables): sequences
of different lengths leave the batch at different steps and others join mid-way, so rows move and
the kept block tables are rewritten from the first changed row; one sequence asks for logprobs, so
steps alternate between the plain-greedy draw and the general one (and, overlapped, between steps
run ahead and steps read at once). Every greedy output must equal the fp32 reference."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from common.cuda import cuda_available
from common.daemon.runtime import ModelRuntime
from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import Finish, Tokens
from common.transfer import KVConsumer, KVProducer
from decode_server.config import DecodeConfig
from decode_server.requests import DecodeRequests
from decode_server.startup import load_runtime
from tests.support.decode import FakeLink, Side, decode_until

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)"),
]


@pytest.fixture
def rt(tmp_path: Path) -> Iterator[ModelRuntime]:
    cfg = DecodeConfig(
        runtime_dir=tmp_path, device="cuda:0", dtype="float32", num_blocks=256, block_size=4
    )
    runtime = load_runtime(cfg)
    yield runtime
    runtime.close()


@pytest.mark.parametrize("overlap", [False, True])
async def test_a_changing_batch_decodes_the_reference_through_the_graphs(rt, overlap) -> None:
    """Overlapped (decode_server/overlap.py): the greedy stretches run ahead (tokens carried
    on the device through the graphs' inputs), the stretch with the logprobs row does not."""
    layout = PoolLayout(**{**rt.layout.to_wire(), "num_blocks": 512})
    pool = KVPool.create(layout, rt.device)
    side = Side(KVProducer(pool, BlockAllocator(512), rt.backend, event_slots=4), rt)
    rng = random.Random(11)
    params = []
    for i in range(8):
        p = SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True)
        params.append(msgspec.structs.replace(p, logprobs=1) if i == 5 else p)
    prompts = [[rng.randrange(256) for _ in range(rng.choice([3, 16, 33, 70]))] for _ in params]
    handoffs = [
        side.prefill(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))
    ]
    torch.cuda.synchronize()
    # in one process the producer's pool is read directly (as in test_decode_pull_gpu.py)
    consumer = KVConsumer(rt.pool, side.pool, side.producer.region, None, torch.cuda.Stream())
    link = FakeLink("link-g", consumer)
    table = DecodeRequests(rt, max_batch=8, overlap="on" if overlap else "off")
    for h in handoffs[:5]:
        table.handoff(link, h)
    await decode_until(table, lambda: len(link.of(Finish)) >= 1)  # the shortest left
    for h in handoffs[5:]:  # join the rows freed and after them
        table.handoff(link, h)
    await decode_until(table, lambda: len(link.of(Finish)) == len(handoffs))
    await consumer.drain()
    for h, p, q in zip(handoffs, prompts, params, strict=True):
        got = [h.first_token] + [
            t for m in link.of(Tokens) if m.request_id == h.request_id for t in m.tokens
        ]
        assert got == reference.generate(rt.model, p, q, block_size=rt.layout.block_size), (
            h.request_id
        )
    rows = sum(q.max_tokens - 1 for q in params)  # a row a step a sequence: built from scratch
    assert table.engine._tables.rewritten < rows  # rows were kept between steps
    assert (table.engine.overlapped > 0) == overlap
    assert rt.allocator.num_free == rt.allocator.total
    consumer.close()
    side.producer.close()
