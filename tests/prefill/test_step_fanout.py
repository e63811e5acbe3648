"""STEP_TOKENS (v10) on the real pipeline (tests.support.prefill_pipeline): one frame with several
requests' tokens, logprobs and FINISHes reaches each request as the TOKENS and FINISH frames it
stands for, in order; a frame naming a request the prefill does not hold changes nothing else;
steps queued before a request's task runs go to its client as one TOKENS frame."""

from __future__ import annotations

import structlog

from common.protocol import Finish, Handoff, KvReady, Release, StepTokens, Tokens, Usage
from common.sampling_params import TokenLogprob
from tests.support.prefill_pipeline import Setup


def _finish(rid: str, n: int) -> Finish:
    usage = Usage(prompt_tokens=20, completion_tokens=n)
    return Finish(request_id=rid, reason="length", usage=usage, timings={"decode_ms": 1.0})


async def test_one_step_frame_fans_out_to_each_request_in_order(cfg_rt) -> None:  # type: ignore[no-untyped-def]
    s = Setup(*cfg_rt)
    s.run_forwards()
    tasks = {rid: s.start(rid, max_tokens=4) for rid in ("a", "b")}
    for rid in tasks:
        await s.until(lambda rid=rid: s.link.of(KvReady, rid))
        slot = s.link.of(Handoff, rid)[0].event_slot
        s.pipeline.deliver(Release(request_id=rid, event_slot=slot))
    lp = TokenLogprob(6, -0.5, [(6, -0.5)])
    with structlog.testing.capture_logs() as logs:  # two steps of both, then one with an
        # unknown request among them; b's FINISH in the middle frame, a's in the last
        s.pipeline.deliver(StepTokens(request_ids=["a", "b"], tokens=[5, 50], logprobs=None))
        s.pipeline.deliver(
            StepTokens(
                request_ids=["b", "a", "b"],
                tokens=[51, 6, 52],
                logprobs=[None, lp, None],
                finishes=[_finish("b", 4)],
            )
        )
        s.pipeline.deliver(
            StepTokens(request_ids=["gone", "a"], tokens=[1, 7], finishes=[_finish("a", 4)])
        )
    got = {rid: await task for rid, task in tasks.items()}
    assert not [e for e in logs if e["log_level"] in ("warning", "error")], logs
    for rid, tail in (("a", [5, 6, 7]), ("b", [50, 51, 52])):
        frames = got[rid]
        first = s.link.of(KvReady, rid)[0].first_token
        assert [t for f in frames if isinstance(f, Tokens) for t in f.tokens] == [first, *tail]
        assert isinstance(frames[-1], Finish) and frames[-1].usage.completion_tokens == 4
    # the three steps reached b's inbox before its task ran: relayed as one frame; a's frames
    # keep apart the token that has a logprob from those that have none
    assert [f.tokens for f in got["b"][1:-1]] == [[50, 51, 52]]
    assert [(f.tokens, f.logprobs) for f in got["a"][1:-1]] == [
        ([5], None),
        ([6], [lp]),
        ([7], None),
    ]
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()
