"""The decode's stream-ordered pull on CUDA: a sequence joins the batch as soon as its pull is
enqueued, and the first step that reads its blocks waits for the copy on the GPU, not the host.

The pull stream is held back by a long GPU spin queued ahead of the pulls (a slow producer or a
slow copy), so a step that did not wait on the pull's event would read blocks not yet copied and
decode different tokens; the greedy outputs must equal the reference."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.daemon.runtime import ModelRuntime
from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import Finish, Release, Tokens
from common.transfer import KVConsumer, KVProducer
from decode_server.config import DecodeConfig
from decode_server.requests import DecodeRequests
from decode_server.startup import load_runtime
from tests.support.decode import FakeLink, Side, decode_until

pytestmark = pytest.mark.gpu

SPIN = 200_000_000  # torch.cuda._sleep cycles: ~100 ms at H200 clocks
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def rt(tmp_path: Path) -> Iterator[ModelRuntime]:
    cfg = DecodeConfig(
        runtime_dir=tmp_path, device="cuda:0", dtype="float32", num_blocks=256, block_size=4
    )
    runtime = load_runtime(cfg)
    yield runtime
    runtime.close()


async def test_sequences_join_before_their_pull_completes_and_decode_the_reference(rt) -> None:
    layout = PoolLayout(**{**rt.layout.to_wire(), "num_blocks": 512})
    side = Side(
        KVProducer(
            KVPool.create(layout, rt.device), BlockAllocator(512), rt.backend, event_slots=4
        ),
        rt,
    )
    side.producer.allocator.allocate("pad", 100)  # source ids differ from the decode's
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.choice([3, 16, 33, 70]))] for _ in range(8)]
    handoffs = [side.prefill(f"r{i}", p, PARAMS) for i, p in enumerate(prompts)]
    torch.cuda.synchronize()
    pull_stream = torch.cuda.Stream(rt.device)
    # in one process the producer's pool is read directly (an IPC handle cannot be reopened by
    # its exporter); the stream-ordered pull and the engine are the daemon's own
    consumer = KVConsumer(rt.pool, side.pool, side.producer.region, None, pull_stream)
    link = FakeLink("link-g", consumer)
    table = DecodeRequests(rt, max_batch=8)
    with torch.cuda.stream(pull_stream):
        torch.cuda._sleep(SPIN)  # every pull below queues behind this
    for h in handoffs:
        table.handoff(link, h)
    assert len(table) == len(prompts)  # joined at once, copies still queued on the GPU
    assert link.of(Release) == []  # RELEASE only once the waiter has seen a copy complete
    await decode_until(table, lambda: len(link.of(Finish)) == len(prompts))
    await consumer.drain()
    for h, p in zip(handoffs, prompts, strict=True):
        got = [h.first_token] + [
            t for m in link.of(Tokens) if m.request_id == h.request_id for t in m.tokens
        ]
        want = reference.generate(rt.model, p, PARAMS, block_size=rt.layout.block_size)
        assert got == want, f"{h.request_id} decoded blocks not yet pulled"
    assert sorted(r.request_id for r in link.of(Release)) == sorted(h.request_id for h in handoffs)
    assert rt.allocator.num_free == rt.allocator.total
    consumer.close()
    side.producer.close()


async def test_a_links_warm_pull_copies_a_peer_block_into_scratch_and_frees_it(rt) -> None:
    layout = PoolLayout(**{**rt.layout.to_wire(), "num_blocks": 64})
    peer = KVPool.create(layout, rt.device)
    peer.tensor.copy_(torch.randn(layout.shape, device=rt.device))
    consumer = KVConsumer(
        rt.pool, peer, SimpleNamespace(close=lambda: None), None, torch.cuda.Stream(rt.device)
    )
    done: list[BaseException | None] = []
    assert consumer.warm(5, done.append)
    await consumer.drain()  # done ran on the loop, once the waiter saw the copy complete
    assert done == [None]
    assert torch.equal(rt.pool.tensor[5], peer.tensor[0])
    link = FakeLink("link-w", consumer)
    table = DecodeRequests(rt, max_batch=8)
    table.warm_pull(link)  # through the table: its scratch block is owned until done
    assert "warm-pull@link-w" in rt.allocator and rt.allocator.num_free == rt.allocator.total - 1
    await consumer.drain()
    assert "warm-pull@link-w" not in rt.allocator
    assert rt.allocator.num_free == rt.allocator.total and link.frames == []
    consumer.close()
