"""The decode's frames as events of a request's phase, on the real pipeline (tests.support.
prefill_pipeline): a frame the phase cannot take is logged with the request id and changes
nothing; a RELEASE after the decode's FINISH still counts; a refused offer goes again through
the one send path; FINISH carries the prefill's timings under their keys."""

from __future__ import annotations

import pytest
import structlog

from common.protocol import (
    Abort,
    Error,
    ErrorCode,
    Finish,
    Handoff,
    KvReady,
    Release,
    Tokens,
    Usage,
)
from prefill_server.phase import Phase
from tests.support.prefill_pipeline import Setup

PREFILL_KEYS = [
    "ttft_ms",
    "prefill_admit_us",
    "prefill_queue_us",
    "prefill_forward_us",
    "first_out_us",  # prefill_read_us needs the server's read time: not given here
    "handoff_us",
    "handoff_after_first_us",
    "total_ms",
]


def _finish() -> Finish:
    usage = Usage(prompt_tokens=20, completion_tokens=4)
    return Finish(request_id="r1", reason="length", usage=usage, timings={"decode_ms": 1.0})


def _out_of_phase(logs: list[dict]) -> list[tuple[str, str, str]]:
    return [
        (e["request_id"], e["type"], e["phase"])
        for e in logs
        if e["event"] == "decode_frame_out_of_phase" and e["log_level"] == "error"
    ]


async def test_frames_its_phase_cannot_take_are_logged_with_the_request_id_and_dropped(
    cfg_rt,  # type: ignore[no-untyped-def]
) -> None:
    s = Setup(*cfg_rt)
    task = s.start("r1")
    await s.until(lambda: s.link.of(Handoff, "r1"))  # offered early, its forward not run yet
    slot = s.link.of(Handoff, "r1")[0].event_slot
    with structlog.testing.capture_logs() as logs:
        s.pipeline.deliver(Release(request_id="r1", event_slot=slot))  # its KV is being written
        s.pipeline.deliver(Tokens(request_id="r1", tokens=[9]))
        s.pipeline.deliver(_finish())
    assert _out_of_phase(logs) == [
        ("r1", "RELEASE", "OFFERED"),
        ("r1", "TOKENS", "OFFERED"),
        ("r1", "FINISH", "OFFERED"),
    ]
    assert s.pipeline.requests["r1"].phase is Phase.OFFERED
    assert "r1" in s.rt.allocator and s.rt.allocator.num_leased == 0  # its blocks, not freed

    s.run_forwards()
    await s.until(lambda: s.link.of(KvReady, "r1"))  # nothing stray in its inbox held it back
    s.pipeline.deliver(Release(request_id="r1", event_slot=slot))
    with structlog.testing.capture_logs() as logs:
        s.pipeline.deliver(Release(request_id="r1", event_slot=slot))  # a second one
        s.pipeline.deliver(Error(code=ErrorCode.NO_CAPACITY, message="late", request_id="r1"))
    assert _out_of_phase(logs) == [("r1", "RELEASE", "RELEASED"), ("r1", "ERROR", "RELEASED")]
    s.pipeline.deliver(Tokens(request_id="r1", tokens=[5, 6, 7]))
    s.pipeline.deliver(_finish())
    frames = await task
    first = s.link.of(KvReady, "r1")[0].first_token
    assert [t for f in frames if isinstance(f, Tokens) for t in f.tokens] == [first, 5, 6, 7]
    assert isinstance(frames[-1], Finish) and frames[-1].reason == "length"
    assert s.link.of(Abort, "r1") == []
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


async def test_a_release_after_the_decodes_finish_frees_and_counts_and_aborts_nothing(
    cfg_rt,  # type: ignore[no-untyped-def]
) -> None:
    """On CUDA the decode's RELEASE waits for the copy's event on its waiter thread, so FINISH
    (after a step that only waited on the GPU) can come first."""
    s = Setup(*cfg_rt)
    s.run_forwards()
    task = s.start("r1")
    await s.until(lambda: s.link.of(KvReady, "r1"))
    slot = s.link.of(Handoff, "r1")[0].event_slot
    s.pipeline.deliver(Tokens(request_id="r1", tokens=[5, 6, 7]))
    s.pipeline.deliver(_finish())
    assert s.pipeline.requests["r1"].phase is Phase.ANSWERED
    with structlog.testing.capture_logs() as logs:
        s.pipeline.deliver(Release(request_id="r1", event_slot=slot))
    assert _out_of_phase(logs) == []
    frames = await task
    assert frames[-1].timings["handoff_us"] > 0  # the RELEASE was counted
    assert s.link.of(Abort, "r1") == []  # the decode holds nothing: no ABORT, no quarantine
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


async def test_a_refused_early_offer_goes_again_with_its_first_token_and_no_kv_ready(
    cfg_rt,  # type: ignore[no-untyped-def]
) -> None:
    s = Setup(*cfg_rt)
    task = s.start("r1")
    await s.until(lambda: s.link.of(Handoff, "r1"))
    s.pipeline.deliver(Error(code=ErrorCode.NO_CAPACITY, message="full", request_id="r1"))
    assert s.pipeline.requests["r1"].phase is Phase.REFUSED
    s.run_forwards()
    await s.until(lambda: len(s.link.of(Handoff, "r1")) == 2)
    early, again = s.link.of(Handoff, "r1")
    assert early.first_token is None and again.first_token is not None
    assert s.link.of(KvReady, "r1") == []  # the KV went with the second HANDOFF
    assert s.pipeline.requests["r1"].phase is Phase.LEASED
    s.pipeline.deliver(Release(request_id="r1", event_slot=again.event_slot))
    s.pipeline.deliver(Tokens(request_id="r1", tokens=[5, 6, 7]))
    s.pipeline.deliver(_finish())
    frames = await task
    assert frames[0].tokens == [again.first_token]
    assert frames[-1].timings["handoff_after_first_us"] > 0  # the retry went after the token
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


@pytest.mark.parametrize("max_tokens", [1, 4])
async def test_finish_carries_the_prefills_timings_after_the_decodes(
    cfg_rt,  # type: ignore[no-untyped-def]
    max_tokens: int,
) -> None:
    s = Setup(*cfg_rt)
    s.run_forwards()
    task = s.start("r1", max_tokens=max_tokens)
    if max_tokens > 1:
        await s.until(lambda: s.link.of(KvReady, "r1"))
        slot = s.link.of(Handoff, "r1")[0].event_slot
        s.pipeline.deliver(Release(request_id="r1", event_slot=slot))
        s.pipeline.deliver(Tokens(request_id="r1", tokens=[5, 6, 7]))
        s.pipeline.deliver(_finish())
    timings = (await task)[-1].timings
    if max_tokens == 1:  # ended at its first token: no handoff, the keys still there
        assert s.link.sent == []
        assert list(timings) == PREFILL_KEYS
        assert timings["handoff_us"] == timings["handoff_after_first_us"] == 0.0
    else:
        assert list(timings) == ["decode_ms", *PREFILL_KEYS]
        assert timings["handoff_after_first_us"] < 0  # the early HANDOFF: before the token
        assert timings["handoff_us"] > 0
    assert timings["total_ms"] >= timings["ttft_ms"] > 0
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()
