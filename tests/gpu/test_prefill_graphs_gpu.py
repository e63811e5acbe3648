"""The prefill's CUDA graphs (common.model.prefill_graphs) against the eager forward, on the GPU:
the same logits and the same K/V written for fresh prompts, cached prefixes and mixed batches;
padding writes nothing; a replay after another bucket's gives its own answer."""

from __future__ import annotations

import pytest
import torch

from common.cuda import cuda_available
from common.model import load_model, slots_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)"),
]
BLOCK = 16


@pytest.fixture(scope="module")
def model():
    m, _ = load_model(None, device="cuda:0", dtype=torch.float32)
    return m


def _graphs(model, kv, max_tokens=256, max_blocks=16):
    from common.model.prefill_graphs import PrefillGraphs

    g = PrefillGraphs(model, kv, max_tokens=max_tokens, max_seqs=4, max_blocks=max_blocks)
    assert g.capture() == sum(1 for t in g.tokens for s in g.seqs if s <= t)
    return g


def _case(model, prompts, starts, tables, max_tokens=256):
    """(eager logits, eager pool, graph logits, graph pool): the contexts written first, by the
    eager forward, into two identical pools; then the pieces after them, each way."""
    v = model.config.vocab_size
    width = max(16, *(len(t) for t in tables))
    pools = [model.new_kv_cache(max(64, sum(map(len, tables)) + 1), BLOCK) for _ in range(2)]
    for kv in pools:
        kv.normal_()  # what nothing writes must stay as it was
    pools[1].copy_(pools[0])
    for kv in pools:
        for p, t, a in zip(prompts, tables, starts, strict=True):
            if a:
                model.prefill_batch([torch.tensor(p[:a])], [slots_for(t, 0, a, BLOCK)], kv)
    pieces = [p[a:] for p, a in zip(prompts, starts, strict=True)]
    slots = [slots_for(t, a, len(x), BLOCK) for x, t, a in zip(pieces, tables, starts, strict=True)]
    eager = model.prefill_batch(
        [torch.tensor(x) for x in pieces], slots, pools[0], starts=starts, block_tables=tables
    )
    g = _graphs(model, pools[1], max_tokens, width)
    bucket = g.bucket_for([len(x) for x in pieces], [len(t) for t in tables])
    assert bucket is not None and bucket[0] < 2 * sum(map(len, pieces))
    graphed = g.run(pieces, slots, starts, tables, bucket).clone()
    assert graphed.shape == (len(prompts), v)
    return eager, pools[0], graphed, pools[1]


@pytest.mark.parametrize(
    ("lengths", "starts", "max_tokens"),
    [
        ([40], [0], 256),
        ([100], [64], 256),
        ([17, 5, 90], [0, 0, 48], 256),
        ([16, 16, 16, 16], [0, 16, 0, 0], 256),
        # past 1,024 tokens the buckets grow by a quarter: 1,100 tokens replay the 1,280 graph,
        # 300 + 1,000 (after 700 cached) the 1,536 one
        ([1100], [0], 2048),
        ([300, 1700], [0, 700], 2048),
    ],
)
def test_a_replay_equals_the_eager_forward(model, lengths, starts, max_tokens):
    v = model.config.vocab_size
    prompts = [[(11 * i + 7 * s + 3) % v for i in range(n)] for s, n in enumerate(lengths)]
    tables, nxt = [], 1
    for n in lengths:
        need = -(-n // BLOCK)
        tables.append(list(range(nxt + need - 1, nxt - 1, -1)))  # scattered: descending ids
        nxt += need
    eager, kv_eager, graphed, kv_graph = _case(model, prompts, starts, tables, max_tokens)
    torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-3)
    assert graphed.argmax(-1).tolist() == eager.argmax(-1).tolist()
    # the same K/V written where the prompts' slots are, and nothing anywhere else
    torch.testing.assert_close(kv_graph, kv_eager, rtol=1e-3, atol=1e-3)


def test_buckets_too_large_fall_back_to_eager(model):
    kv = model.new_kv_cache(64, BLOCK)
    g = _graphs(model, kv)
    assert g.bucket_for([257], [17]) is None  # more tokens than captured
    assert g.bucket_for([10] * 5, [1] * 5) is None  # more prompts than captured
    assert g.bucket_for([10], [17]) is None  # a wider table than captured
    assert g.bucket_for([10, 10], [1, 1]) == (32, 2)
