"""The prefill's first tokens over CUDA graphs' static outputs, emulated on the CPU (issue 42:
structured output failed on CUDA only). `StaticPrefillGraphs` (tests/support/static_graphs.py)
stands in for PrefillGraphs, a fault the CPU cannot cause for real: each forward's last-token
logits are a view of its bucket's buffer, which the bucket's next forward overwrites.

Two forwards of the same bucket back to back, each with a greedy and a sampled constrained prompt
beside a plain greedy one (its first token written to the mailbox: KV_LAUNCHED) and a sampled
one: every first token is its single-process answer's, only the plain greedy prompt is
launched early, and the mailbox holds its token."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from common.daemon.runtime import ModelRuntime
from common.model import reference
from common.model.sampling import SamplingParams
from common.sampling_params import StructuredOutput
from common.transfer import KVProducer
from prefill_server.forward import FirstToken, Piece, run_prefill_batch
from tests.support.daemons import BLOCK
from tests.support.schemas import SCHEMAS
from tests.support.static_graphs import StaticPrefillGraphs
from tests.support.structured import constrained_generate

pytest.importorskip("llguidance")


def _json(schema: dict, **kw) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(structured=StructuredOutput("json_schema", json.dumps(schema)), **kw)


PARAMS = [
    _json(SCHEMAS[1], max_tokens=50),
    _json(SCHEMAS[4], max_tokens=50, temperature=1.0, seed=5),
    SamplingParams(max_tokens=8, ignore_eos=True),  # launches early
    SamplingParams(max_tokens=8, temperature=0.8, seed=2, ignore_eos=True),
]
PLAIN = 2  # the index of the prompt that launches early


@pytest.fixture
def producer(rt: ModelRuntime) -> Iterator[KVProducer]:
    """A CPU producer over the runtime's pool with a CPU mailbox of 8 unset entries (as in
    tests/prefill/test_launch_early.py); the test's blocks are freed after it."""
    prod = KVProducer(rt.pool, rt.allocator, rt.backend, event_slots=1)
    prod.mailbox = torch.full((8,), -1, dtype=torch.int64)
    before = rt.allocator.requests()
    yield prod
    for rid in set(rt.allocator.requests()) - set(before):
        rt.allocator.free(rid)


def _want(rt: ModelRuntime, prompt: list[int], params: SamplingParams) -> int:
    if params.structured is None:
        return reference.generate(rt.model, prompt, params, block_size=BLOCK)[0]
    return constrained_generate(rt.model, rt.tokenizer, prompt, params, block_size=BLOCK)[0]


def test_first_tokens_over_static_prefill_outputs_are_the_single_process_ones(
    rt: ModelRuntime, producer: KVProducer
) -> None:
    graphs = StaticPrefillGraphs(rt, max_tokens=64, max_seqs=4, max_blocks=8)
    rt.graphs = graphs
    try:
        for batch in range(2):
            prompts = [[256, *f"prompt {batch}.{i}: ".encode()] for i in range(len(PARAMS))]
            pieces = []
            for i, (prompt, params) in enumerate(zip(prompts, PARAMS, strict=True)):
                blocks = rt.allocator.allocate(f"b{batch}-{i}", -(-len(prompt) // BLOCK))
                pieces.append(Piece(prompt, 0, len(prompt), blocks, params, slot=i))
            calls: list[list[int]] = []
            firsts = run_prefill_batch(
                rt, pieces, producer, token_budget=8192, launched=calls.append
            )
            want = [_want(rt, p, s) for p, s in zip(prompts, PARAMS, strict=True)]
            got = [f.token if isinstance(f, FirstToken) else f for f in firsts]
            assert got == want, batch
            assert not any(isinstance(f, FirstToken) and f.complete for f in firsts)
            assert calls == [[PLAIN]]
            assert int(producer.mailbox[PLAIN]) == want[PLAIN]
    finally:
        rt.graphs = None
    assert list(graphs.replays.values()) == [2], graphs.replays  # one bucket, twice
