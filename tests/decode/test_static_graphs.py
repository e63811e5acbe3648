"""The decode's steps over CUDA graphs' static outputs, emulated on the CPU (issue 42: structured
output failed on CUDA only). `StaticDecodeGraphs` (tests/support/static_graphs.py) stands in for
DecodeRunner: each step's argmax and logits are views of per-bucket buffers that any later step
may overwrite (junk in all of them at each step), and carried tokens are taken as DecodeRunner
takes them. The graphs
are a fault the CPU cannot cause for real, hence the stand-in.

Greedy constrained, plain greedy, then sampled (constrained and plain) sequences joining later,
with overlapped steps off, on and always, with every step replayed or some eager (block tables
wider than the graphs take): the batch runs 1 to 9 rows (several of the buckets 1 to 16, one
replayed back to back), and the tokens of a step launched ahead reach the host only once it
waits for them (LateReadback); every sequence's tokens equal its single-process answer (the
reference, or the same under its grammar), every constrained answer validating."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator

import msgspec
import pytest
import torch

from common.daemon.runtime import ModelRuntime
from common.model import reference
from common.protocol import Finish, Tokens
from common.sampling_params import SamplingParams, StructuredOutput
from decode_server.config import DecodeConfig
from decode_server.requests import DecodeRequests
from decode_server.startup import load_runtime
from tests.support.decode import FakeLink, Side, decode_until
from tests.support.schemas import SCHEMAS
from tests.support.static_graphs import LateReadback, StaticDecodeGraphs
from tests.support.structured import constrained_generate, first_difference, validate_json

pytest.importorskip("llguidance")

MAX_BATCH = 16
SMALL = [SCHEMAS[i] for i in (1, 4, 6, 8, 9, 16, 18, 23)]


def _json(schema: dict, **kw) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(structured=StructuredOutput("json_schema", json.dumps(schema)), **kw)


#: (prompt, params, schema or None); the first six join at once, the last three a few steps later
FIRST = [
    *(
        ([256, *f"greedy {i}:".encode()], _json(SMALL[i], max_tokens=200), SMALL[i])
        for i in range(4)
    ),
    ([256, *b"plain long"], SamplingParams(max_tokens=80, ignore_eos=True), None),
    ([256, *b"plain short"], SamplingParams(max_tokens=9, ignore_eos=True), None),
]
LATER = [
    *(
        (
            [256, *f"sampled {i}:".encode()],
            _json(SMALL[4 + i], max_tokens=200, temperature=1.0, seed=i),
            SMALL[4 + i],
        )
        for i in range(2)
    ),
    (
        [256, *b"sampled plain"],
        SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
        None,
    ),
]


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelRuntime]:
    """A CPU runtime with room for nine sequences of up to 200 tokens (4-token blocks)."""
    cfg = DecodeConfig(
        runtime_dir=tmp_path_factory.mktemp("rt"), device="cpu", num_blocks=600, block_size=4
    )
    runtime = load_runtime(cfg)
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def answers(rt: ModelRuntime) -> list[list[int]]:
    """Each case's single-process answer (its first token included)."""
    bs = rt.layout.block_size
    out = []
    for prompt, params, schema in [*FIRST, *LATER]:
        if schema is None:
            out.append(reference.generate(rt.model, prompt, params, block_size=bs))
        else:
            out.append(constrained_generate(rt.model, rt.tokenizer, prompt, params, block_size=bs))
    return out


def _handoff(side: Side, rid: str, prompt: list[int], params: SamplingParams, first: int):  # type: ignore[no-untyped-def]
    h = side.prefill(rid, prompt, params)
    return msgspec.structs.replace(h, first_token=first)


async def _decode(table: DecodeRequests, link: FakeLink, side: Side, answers) -> None:  # type: ignore[no-untyped-def]
    cases = [*FIRST, *LATER]
    for i, (prompt, params, _) in enumerate(FIRST):
        table.handoff(link, _handoff(side, f"r{i}", prompt, params, answers[i][0]))
    loop = asyncio.create_task(table.run())
    try:
        async with asyncio.timeout(60):
            while table.engine.steps < 4:
                assert not loop.done(), loop.exception()
                await asyncio.sleep(0.001)
            for j, (prompt, params, _) in enumerate(LATER, start=len(FIRST)):
                table.handoff(link, _handoff(side, f"r{j}", prompt, params, answers[j][0]))
            while len(link.of(Finish)) < len(cases):
                assert not loop.done(), loop.exception()
                await asyncio.sleep(0.002)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


def _late_readback(table: DecodeRequests, rt: ModelRuntime) -> LateReadback | None:
    """The steps launched ahead read their tokens from copies that land only once waited on,
    as on CUDA (None without overlapped steps)."""
    ahead = table.engine.ahead_steps
    if ahead is None:
        return None
    late = LateReadback(MAX_BATCH, rt.device, rt.model.config.vocab_size - 1)
    ahead._readback = late
    return late


@pytest.mark.parametrize("max_blocks", [64, 24], ids=["all-replayed", "some-eager"])
@pytest.mark.parametrize("overlap", ["off", "on", "always"])
async def test_static_step_outputs_give_the_single_process_answers(
    rt, side: Side, link: FakeLink, answers, overlap: str, max_blocks: int
) -> None:  # type: ignore[no-untyped-def]
    graphs = StaticDecodeGraphs(rt, max_batch=MAX_BATCH, max_blocks=max_blocks)
    rt.graphs = graphs
    table = DecodeRequests(rt, max_batch=MAX_BATCH, overlap=overlap)
    late = _late_readback(table, rt)
    try:
        await _decode(table, link, side, answers)
    finally:
        rt.graphs = None
        for i in range(len(FIRST) + len(LATER)):
            side.producer.allocator.free(f"r{i}")
    streams: dict[str, list[int]] = {}
    for m in link.of(Tokens):
        streams.setdefault(m.request_id, []).extend(m.tokens)
    finish = {f.request_id: f.reason for f in link.of(Finish)}
    wrong = []
    for i, ((_, _, schema), want) in enumerate(zip([*FIRST, *LATER], answers, strict=True)):
        got = [want[0], *streams.get(f"r{i}", [])]
        if got != want:
            wrong.append(f"r{i}: {first_difference(got, want)}")
        elif schema is not None:
            text = bytes(t for t in got if t < 256).decode()
            assert finish[f"r{i}"] == "stop", (i, text)
            validate_json(text, schema)
    assert not wrong, "\n".join(wrong)
    assert rt.allocator.num_free == rt.allocator.total
    # the emulation was exercised: several buckets, one replayed back to back (or, with narrow
    # graphs, steps replayed beside eager ones), tokens carried from a step ahead
    replayed = sum(graphs.replays.values())
    if max_blocks == 64:
        assert len(graphs.replays) >= 3 and graphs.back_to_back > 0, graphs.replays
    else:
        assert 0 < replayed < table.engine.steps, (graphs.replays, table.engine.steps)
    if overlap != "off":
        assert table.engine.overlapped > 0 and graphs.carried > 0
        assert late is not None and late.started > 0


async def test_a_first_step_launched_alone_then_constrained_ones_join_over_static_outputs(
    rt, side: Side, link: FakeLink, answers
) -> None:  # type: ignore[no-untyped-def]
    """KV_LAUNCHED's first step (CUDA only: launched.py) as far as the CPU can take it: a plain
    sequence's first step launched alone, its token carried from a device tensor (here already
    on the host too, so its KV_READY is not awaited), then greedy constrained sequences join
    and the next steps carry its token from that step's static argmax (bucket 1) into a step
    of bucket 4 whose constrained rows are masked: every answer is the single-process one."""
    graphs = StaticDecodeGraphs(rt, max_batch=MAX_BATCH, max_blocks=64)
    rt.graphs = graphs
    table = DecodeRequests(rt, max_batch=MAX_BATCH, overlap="always")
    _late_readback(table, rt)
    picked = [4, 0, 1, 2]  # the plain long one first, then three constrained
    try:
        prompt, params, _ = FIRST[4]
        table.handoff(link, _handoff(side, "r4", prompt, params, answers[4][0]))
        (seq,) = table.engine.sequences()
        seq.first_on_device = torch.tensor([answers[4][0]])
        assert table.engine.ahead_steps is not None
        table.engine.ahead_steps.add_first(seq)
        table.step_done(await table.engine.step())  # launched alone, nothing read yet
        assert table.engine.ahead and graphs.replays == {1: 1} and graphs.carried == 1
        for i in picked[1:]:
            prompt, params, _ = FIRST[i]
            table.handoff(link, _handoff(side, f"r{i}", prompt, params, answers[i][0]))
        await decode_until(table, lambda: len(link.of(Finish)) >= len(picked), timeout=60)
    finally:
        rt.graphs = None
        for i in picked:
            side.producer.allocator.free(f"r{i}")
    streams: dict[str, list[int]] = {}
    for m in link.of(Tokens):
        streams.setdefault(m.request_id, []).extend(m.tokens)
    for i in picked:
        got = [answers[i][0], *streams[f"r{i}"]]
        assert got == answers[i], f"r{i}: {first_difference(got, answers[i])}"
    assert graphs.replays[4] > 0 and table.engine.overlapped > 0
    assert rt.allocator.num_free == rt.allocator.total
