"""The decode's answers to a step (v10): one STEP_TOKENS per link per step carrying every one of
that link's sequences, logprobs only where asked, each FINISH in the frame of its last token;
a step of more than MAX_STEP_ENTRIES of a link's sequences goes in several frames. Real forward
passes through the fake links of tests.support.decode."""

from __future__ import annotations

import msgspec

from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import MAX_STEP_ENTRIES, Finish, StepTokens, Tokens, Usage
from common.sampling_params import TokenLogprob
from decode_server.answers import Outbox
from tests.support.decode import FakeLink, Side, decode_until, open_consumer

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


async def test_each_step_is_one_frame_per_link_with_every_sequence(side: Side, link, table, rt):  # type: ignore[no-untyped-def]
    other = FakeLink("link-b", open_consumer(side, rt.pool))
    asks = msgspec.structs.replace(GREEDY, logprobs=2, max_tokens=7)
    plan = {"a1": (link, GREEDY), "a2": (link, asks), "b1": (other, GREEDY)}
    prompts = {rid: [5 + i, 17, 99, 3, 42 + i] for i, rid in enumerate(plan)}
    firsts = {}
    for rid, (peer, params) in plan.items():
        h = side.prefill(rid, prompts[rid], params)
        firsts[rid] = h.first_token
        table.handoff(peer, h)
    try:
        await decode_until(table, lambda: len(link.of(Finish)) == 2 and other.of(Finish))
    finally:
        other.consumer.close()
    for peer, rids in ((link, ["a1", "a2"]), (other, ["b1"])):
        steps = [f for f in peer.frames if isinstance(f, StepTokens)]
        assert not [f for f in peer.frames if isinstance(f, Tokens | Finish)]
        longest = max(plan[r][1].max_tokens for r in rids)
        assert len(steps) == longest - 1  # one frame a step while any of them decodes
        for i, frame in enumerate(steps):
            live = [r for r in rids if i < plan[r][1].max_tokens - 1]
            assert sorted(frame.request_ids) == live, (i, frame)
            assert [f.request_id for f in frame.finishes] == [
                r for r in live if i == plan[r][1].max_tokens - 2
            ]
        for rid in rids:
            params = plan[rid][1]
            got = [firsts[rid]] + [
                t for m in peer.of(Tokens) if m.request_id == rid for t in m.tokens
            ]
            bs = rt.layout.block_size
            assert got == reference.generate(rt.model, prompts[rid], params, block_size=bs)
            lps = [m.logprobs for m in peer.of(Tokens) if m.request_id == rid]
            if params.logprobs is None:
                assert lps == [None] * (params.max_tokens - 1)
            else:
                assert [lp[0].token for lp in lps] == got[1:] and all(
                    len(lp[0].top) == 2 for lp in lps
                )
    for rid in plan:
        side.producer.allocator.free(rid)


def test_a_step_of_more_than_a_frame_holds_goes_in_several_in_order() -> None:
    peer = FakeLink("link-x", consumer=None)  # type: ignore[arg-type]
    out = Outbox()
    n = MAX_STEP_ENTRIES * 2 + 3
    lp = TokenLogprob(1, -0.1, [])
    for i in range(n):
        out.token(peer, f"r{i}", i % 7, lp if i == MAX_STEP_ENTRIES + 1 else None)
        if i % 500 == 0:
            usage = Usage(prompt_tokens=1, completion_tokens=1)
            out.finish(peer, Finish(request_id=f"r{i}", reason="length", usage=usage))
    out.send()
    frames = peer.frames
    assert [len(f.request_ids) for f in frames] == [MAX_STEP_ENTRIES, MAX_STEP_ENTRIES, 3]
    assert [r for f in frames for r in f.request_ids] == [f"r{i}" for i in range(n)]
    assert [f.logprobs is None for f in frames] == [True, False, True]  # asked in the 2nd only
    assert frames[1].logprobs[1] == lp and frames[1].logprobs.count(None) == MAX_STEP_ENTRIES - 1
    for f in frames:  # each FINISH in the frame of its request's token
        assert {x.request_id for x in f.finishes} <= set(f.request_ids)
    assert sum(len(f.finishes) for f in frames) == len(range(0, n, 500))
