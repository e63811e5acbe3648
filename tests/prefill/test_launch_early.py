"""KV_LAUNCHED's prefill side (v12): `run_prefill_batch` writes the first token of each plain
greedy prompt recorded on an event slot into the producer's mailbox entry of that slot before the
record, and names those pieces to its `launched` callback; at most MAX_LAUNCHED a forward.

Run on the tiny model on CPU with a CPU tensor as the mailbox: the CPU producer's `record` is a
no-op, so slots >= 0 are given here as a CUDA daemon's ring would hand them out.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from common.daemon.runtime import ModelRuntime
from common.model import reference
from common.model.sampling import SamplingParams
from common.transfer import KVProducer
from prefill_server.forward import (
    MAX_LAUNCHED,
    FirstToken,
    Piece,
    launches_early,
    run_prefill_batch,
)
from tests.support.daemons import BLOCK
from tests.support.prefill import prompts

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
BUDGET = 8192
UNSET = -1


@pytest.fixture
def producer(rt: ModelRuntime) -> Iterator[KVProducer]:
    """A CPU producer over the runtime's pool, its mailbox a CPU tensor of 8 unset entries; the
    blocks the test allocates are freed after it."""
    prod = KVProducer(rt.pool, rt.allocator, rt.backend, event_slots=1)
    assert prod.mailbox is None  # CPU: the producer offers none of its own
    prod.mailbox = torch.full((8,), UNSET, dtype=torch.int64)
    before = rt.allocator.requests()
    yield prod
    for rid in set(rt.allocator.requests()) - set(before):
        rt.allocator.free(rid)


class Launches:
    """A `launched` callback: each call's piece indices, and the mailbox as it was then."""

    def __init__(self, mailbox: torch.Tensor | None) -> None:
        self.mailbox = mailbox
        self.calls: list[list[int]] = []
        self.seen: list[list[int]] = []

    def __call__(self, indices: list[int]) -> None:
        self.calls.append(list(indices))
        if self.mailbox is not None:
            self.seen.append(self.mailbox.tolist())


def _whole(rt: ModelRuntime, rid: str, prompt: list[int], params, slot: int) -> Piece:  # type: ignore[no-untyped-def]
    blocks = rt.allocator.allocate(rid, -(-len(prompt) // BLOCK))
    return Piece(prompt, 0, len(prompt), blocks, params, slot)


def _first(rt: ModelRuntime, prompt: list[int], params: SamplingParams) -> int:
    return reference.generate(rt.model, prompt, params, block_size=BLOCK)[0]


@pytest.mark.parametrize(
    ("params", "early"),
    [
        (SamplingParams(max_tokens=2), True),
        (SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=(3,), top_k=5), True),
        (SamplingParams(max_tokens=16, temperature=1e-6), True),  # below MIN_TEMPERATURE: greedy
        (SamplingParams(max_tokens=1), False),  # no token after the first: nothing to launch
        (SamplingParams(max_tokens=16, temperature=0.7, seed=1), False),
        (SamplingParams(max_tokens=16, presence_penalty=0.5), False),
        (SamplingParams(max_tokens=16, frequency_penalty=-0.5), False),
        (SamplingParams(max_tokens=16, repetition_penalty=1.2), False),
        (SamplingParams(max_tokens=16, min_tokens=1), False),
        (SamplingParams(max_tokens=16, logprobs=0), False),
        (SamplingParams(max_tokens=16, prompt_logprobs=0), False),
        (SamplingParams(max_tokens=0, prompt_logprobs=2), False),
    ],
)
def test_launches_early_only_for_plain_greedy_requests_with_tokens_to_come(
    params: SamplingParams, early: bool
) -> None:
    assert launches_early(params) is early


def test_eligible_first_tokens_go_to_their_slots_and_the_rest_stay_unset(rt, producer) -> None:  # type: ignore[no-untyped-def]
    texts = prompts(10, [9, 17, 30, 5, 40, 16, 23, 33, 12, 40], seed=21)
    mixed = [  # (params, slot) of each piece; piece 7 is the first chunk of a 40-token prompt
        (GREEDY, 0),
        (SamplingParams(max_tokens=4, temperature=0.8, seed=5), 1),
        (SamplingParams(max_tokens=4, repetition_penalty=1.3), 2),
        (SamplingParams(max_tokens=4, min_tokens=2), 3),
        (SamplingParams(max_tokens=4, logprobs=1), 4),
        (SamplingParams(max_tokens=1), 5),
        (GREEDY, -1),  # no event slot: never launched
        (None, 6),
        (SamplingParams(max_tokens=2), 7),
    ]
    pieces = [_whole(rt, f"e{i}", texts[i], p, s) for i, (p, s) in enumerate(mixed) if p]
    chunked = texts[9]
    chunk_blocks = rt.allocator.allocate("e-chunk", -(-len(chunked) // BLOCK))
    pieces.insert(7, Piece(chunked, 0, 16, chunk_blocks, None, 6))
    launches = Launches(producer.mailbox)
    got = run_prefill_batch(rt, pieces, producer, token_budget=BUDGET, launched=launches)

    assert launches.calls == [[0, 8]]
    box = producer.mailbox.tolist()
    assert launches.seen == [box]  # written before the callback, nothing after it
    assert box[0] == got[0].token == _first(rt, pieces[0].prompt, GREEDY)
    assert box[7] == got[8].token == _first(rt, pieces[8].prompt, pieces[8].sampling)
    assert box[1:7] == [UNSET] * 6
    assert got[7] is None  # the chunk draws nothing
    assert all(isinstance(a, FirstToken) for i, a in enumerate(got) if i != 7)

    # the chunk's last piece, in a later forward, is launched on the chunk's slot
    last = Piece(chunked, 16, len(chunked), chunk_blocks, GREEDY, 6)
    after = Launches(producer.mailbox)
    (tail,) = run_prefill_batch(rt, [last], producer, token_budget=BUDGET, launched=after)
    assert after.calls == [[0]]
    assert producer.mailbox[6].item() == tail.token == _first(rt, chunked, GREEDY)


def test_the_first_tokens_are_those_of_a_run_without_the_mailbox(rt, producer) -> None:  # type: ignore[no-untyped-def]
    texts = prompts(5, [20, 7, 31, 16, 45], seed=8)
    params = [
        GREEDY,
        SamplingParams(max_tokens=4, temperature=0.9, seed=3),
        SamplingParams(max_tokens=4, logprobs=2),
        SamplingParams(max_tokens=4, presence_penalty=1.0),
        SamplingParams(max_tokens=3),
    ]
    pieces = [
        _whole(rt, f"u{i}", p, s, i) for i, (p, s) in enumerate(zip(texts, params, strict=True))
    ]
    mailbox = producer.mailbox
    launches = Launches(mailbox)
    with_box = run_prefill_batch(rt, pieces, producer, token_budget=BUDGET, launched=launches)
    assert launches.calls == [[0, 4]]
    producer.mailbox = None
    plain = Launches(None)
    without = run_prefill_batch(rt, pieces, producer, token_budget=BUDGET, launched=plain)
    assert plain.calls == []  # no mailbox: nothing launched
    assert with_box == without
    assert [mailbox[0].item(), mailbox[4].item()] == [with_box[0].token, with_box[4].token]
    assert with_box[2].logprob is not None  # logprobs still come for the request that asks
    for i in (0, 2, 4):  # greedy: the reference's first token
        assert with_box[i].token == _first(rt, texts[i], params[i])


def test_at_most_max_launched_a_forward_in_piece_order(rt, producer) -> None:  # type: ignore[no-untyped-def]
    texts = prompts(7, [11, 19, 8, 26, 14, 30, 5], seed=13)
    sampled = SamplingParams(max_tokens=4, temperature=0.5, seed=9)
    pieces = [_whole(rt, "m0", texts[0], sampled, 0)]  # not eligible: not counted
    pieces += [_whole(rt, f"m{i}", texts[i], GREEDY, i) for i in range(1, 7)]
    launches = Launches(producer.mailbox)
    got = run_prefill_batch(rt, pieces, producer, token_budget=BUDGET, launched=launches)
    assert MAX_LAUNCHED == 4
    assert launches.calls == [[1, 2, 3, 4]]
    box = producer.mailbox.tolist()
    assert box[1:5] == [got[i].token for i in range(1, 5)]
    assert box[0] == box[5] == box[6] == box[7] == UNSET
    assert all(got[i].token == _first(rt, texts[i], GREEDY) for i in range(1, 7))


def test_without_a_launched_callback_or_a_producer_nothing_is_written(rt, producer) -> None:  # type: ignore[no-untyped-def]
    texts = prompts(3, [13, 29, 16], seed=17)
    pieces = [_whole(rt, f"n{i}", p, GREEDY, i) for i, p in enumerate(texts)]
    got = run_prefill_batch(rt, pieces, producer, token_budget=BUDGET)
    assert producer.mailbox.tolist() == [UNSET] * 8
    launches = Launches(producer.mailbox)
    again = run_prefill_batch(rt, pieces, None, token_budget=BUDGET, launched=launches)
    assert launches.calls == []
    assert producer.mailbox.tolist() == [UNSET] * 8
    assert got == again
    assert [a.token for a in got] == [_first(rt, p, GREEDY) for p in texts]


def test_a_prompt_asking_for_prompt_logprobs_is_not_launched(rt, producer) -> None:  # type: ignore[no-untyped-def]
    text = prompts(1, [21], seed=19)[0]
    scored = SamplingParams(max_tokens=4, prompt_logprobs=1)
    launches = Launches(producer.mailbox)
    (got,) = run_prefill_batch(
        rt, [_whole(rt, "s0", text, scored, 0)], producer, token_budget=BUDGET, launched=launches
    )
    assert launches.calls == []
    assert producer.mailbox.tolist() == [UNSET] * 8
    assert got.prompt_logprobs is not None and got.token == _first(rt, text, GREEDY)
