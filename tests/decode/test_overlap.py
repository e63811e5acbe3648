"""Overlapped decode steps (decode_server/overlap.py) through the decode's request table with real
forward passes on the CPU: each step is launched before the previous one is read, so these
check what that may break: tokens (the reference's, stop tokens and max_tokens included), the
step launched for a sequence that already ended, freeing, and a batch that stops being plain."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import Finish, Tokens
from decode_server.requests import DecodeRequests
from tests.support.decode import FakeLink, Side, decode_until

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 42], [8, 250, 7], [1, 2, 3, 4, 5, 6], [77, 66]]


@pytest.fixture
def table(rt):  # type: ignore[no-untyped-def]
    requests = DecodeRequests(rt, max_batch=8, overlap="on")
    yield requests
    assert rt.allocator.num_free == rt.allocator.total, "a test left decode blocks owned"


def _streams(link: FakeLink) -> dict[str, list[int]]:
    """Each request's tokens as the link saw them, checking none follows its FINISH."""
    out: dict[str, list[int]] = {}
    done: set[str] = set()
    for m in link.sent:
        if isinstance(m, Tokens):
            assert m.request_id not in done, f"TOKENS after FINISH for {m.request_id}"
            out.setdefault(m.request_id, []).extend(m.tokens)
        elif isinstance(m, Finish):
            assert m.request_id not in done
            done.add(m.request_id)
    return out


def _assert_reference(rt, link: FakeLink, cases) -> None:  # type: ignore[no-untyped-def]
    """Each (handoff, prompt, params) of `cases`: its first token and the link's stream of it
    are what the single-process reference generates."""
    got = _streams(link)
    for h, prompt, params in cases:
        want = reference.generate(rt.model, prompt, params, block_size=rt.layout.block_size)
        assert [h.first_token, *got.get(h.request_id, [])] == want, h.request_id


def _stop_at_third(rt, prompt: list[int]) -> SamplingParams:  # type: ignore[no-untyped-def]
    """Greedy params whose stop token is the 3rd token the reference generates: it stops on a
    token, with tokens of max_tokens left (its next step was launched already)."""
    ref = reference.generate(rt.model, prompt, GREEDY, block_size=rt.layout.block_size)
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(ref[2],))


async def test_overlapped_steps_give_the_reference_tokens_and_free_every_block(
    side: Side, link, table, rt
):
    """Different lengths (a sequence finished by length leaves before the step after it), and
    one stopped by a stop token (the step launched after it is dropped): each stream equals the
    reference, nothing follows a FINISH, and every step after the first ran ahead."""
    params = [
        GREEDY,
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        _stop_at_third(rt, PROMPTS[2]),
        SamplingParams(max_tokens=1 + 5, temperature=0.0, ignore_eos=True),
    ]
    handoffs = [
        side.prefill(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))
    ]
    for h in handoffs:
        table.handoff(link, h)
    await decode_until(table, lambda: len(link.of(Finish)) == len(handoffs))
    _assert_reference(rt, link, zip(handoffs, PROMPTS, params, strict=True))
    assert [f.reason for f in link.of(Finish)].count("stop") == 1
    assert table.engine.overlapped >= table.engine.steps - 1 > 0
    for h in handoffs:
        side.producer.allocator.free(h.request_id)


async def test_a_sequence_stopped_by_a_token_keeps_its_blocks_until_the_step_ahead_is_read(
    side: Side, link, table, rt
):
    """Its FINISH goes while the step launched after its last token is still unread (it may
    write the sequence's next slot): its blocks are freed only after that step is read."""
    params = _stop_at_third(rt, PROMPTS[0])
    table.handoff(link, side.prefill("r", PROMPTS[0], params))
    key = "link-a/r"
    for _ in range(20):
        table.step_done(await table.engine.step())
        table._free_ended()
        if link.of(Finish):
            break
    assert link.of(Finish) and table.engine.in_flight(key)
    assert key in rt.allocator  # the step ahead holds it
    table.step_done(await table.engine.step())  # reads it: its token for r is dropped
    table._free_ended()
    assert not table.engine.in_flight(key) and key not in rt.allocator
    assert len(_streams(link)["r"]) == 2  # 3 tokens, the first from the prefill
    side.producer.allocator.free("r")


async def test_a_sampled_sequence_joining_ends_the_overlap_and_both_match_the_reference(
    side: Side, link, table, rt
):
    """A sequence whose token is drawn on the host (temperature, seeded) joins a batch running
    ahead: the step ahead is read first, then the batch runs the ordinary way; both streams are
    the reference's."""
    sampled = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    first = side.prefill("g", PROMPTS[0], GREEDY)
    table.handoff(link, first)
    loop = asyncio.create_task(table.run())
    try:
        async with asyncio.timeout(30):
            while table.engine.overlapped < 2:
                await asyncio.sleep(0.001)
        second = side.prefill("s", PROMPTS[1], sampled)
        table.handoff(link, second)
        async with asyncio.timeout(30):
            while len(link.of(Finish)) < 2:
                assert not loop.done(), loop.exception()
                await asyncio.sleep(0.005)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    _assert_reference(rt, link, [(first, PROMPTS[0], GREEDY), (second, PROMPTS[1], sampled)])
    for rid in ("g", "s"):
        side.producer.allocator.free(rid)


async def test_an_abort_while_a_step_runs_ahead_frees_only_after_it_and_others_go_on(
    side: Side, link, table, rt
):
    """ABORT of a sequence that the step ahead holds: no token of it is sent after, its blocks
    come back once that step is read, and the batch-mate still decodes to the reference."""
    keep = side.prefill("keep", PROMPTS[0], GREEDY)
    gone = side.prefill("gone", PROMPTS[1], GREEDY)
    table.handoff(link, keep)
    table.handoff(link, gone)
    table.step_done(await table.engine.step())  # launched from idle: nothing read yet
    table.step_done(await table.engine.step())
    assert table.engine.in_flight("link-a/gone")
    sent_before = len(_streams(link).get("gone", []))
    table.abort(link, "gone")
    assert "link-a/gone" in rt.allocator
    await decode_until(table, lambda: link.of(Finish))
    assert "link-a/gone" not in rt.allocator
    assert len(_streams(link).get("gone", [])) == sent_before
    _assert_reference(rt, link, [(keep, PROMPTS[0], GREEDY)])
    for rid in ("keep", "gone"):
        side.producer.allocator.free(rid)


async def test_no_step_runs_ahead_while_a_prefill_computes_an_early_handoff(
    side: Side, link, table, rt
):
    """--overlap-steps on: while a sequence awaits its KV (its prefill's forward is running on
    the GPU) steps are launched and read in one go, leaving the gaps between them to that
    forward; once its KV_READY came, steps run ahead again. `always` does not hold."""
    from common.protocol import KvReady
    from tests.support.decode import early

    running = side.prefill("run", PROMPTS[0], GREEDY)
    table.handoff(link, running)
    waiting = side.prefill("wait", PROMPTS[1], GREEDY)
    table.handoff(link, early(waiting))  # AWAITING_KV
    for _ in range(3):
        table.step_done(await table.engine.step())
    assert table.engine.overlapped == 0 and table.engine.held == 3
    table.kv_ready(link, KvReady(request_id="wait", first_token=waiting.first_token))
    await decode_until(table, lambda: len(link.of(Finish)) == 2)
    assert table.engine.overlapped > 0
    _assert_reference(rt, link, [(running, PROMPTS[0], GREEDY), (waiting, PROMPTS[1], GREEDY)])
    always = DecodeRequests(rt, max_batch=8, overlap="always")
    assert always.engine.ahead_steps is not None and always.engine.ahead_steps._hold is None
    for rid in ("run", "wait"):
        side.producer.allocator.free(rid)
