"""The request table's phases: each event moves a request from one phase to the next, and one its
phase does not allow is logged with the request id (and answered only where the protocol says).

Real parts as in test_deferred_pull: the tiny model's forward passes, a shared-memory producer
pool opened through a KVConsumer; the fakes are the CUDA event of a pull still in flight and a
transfer no stream can wait on (NIXL's shape).
"""

from __future__ import annotations

import os
import time

import msgspec
import structlog

from common.model.sampling import SamplingParams
from common.protocol import Error, ErrorCode, Finish, Handoff, KvReady, Release, Tokens
from decode_server.phase import Phase
from decode_server.requests import DecodeRequests
from tests.support.decode import PROMPT, FakeLink, LaterConsumer, Side, decode_until

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
#: the decode's FINISH timings of a request handed off late, on one host
LATE_KEYS = {
    "decode_handoff_us",
    "pull_us",
    "usable_us",
    "first_step_us",
    "admit_us",
    "read_us",
    "wire_us",
    "enqueue_us",
    "join_us",
    "first_launch_us",
    "first_prep_us",
    "first_fill_us",
    "first_sync_us",
    "later_step_us",
    "decode_ms",
}


def early(h: Handoff) -> Handoff:
    return msgspec.structs.replace(h, first_token=None)


def sent_now(link: FakeLink, h: Handoff) -> Handoff:
    """The HANDOFF as a prefill on this host sends it, with its send time; read at once."""
    h = msgspec.structs.replace(h, sent_ns=time.monotonic_ns())
    link.channel.last_rx = time.monotonic()
    return h


def out_of_phase(logs: list[dict]) -> list[tuple[str, str, str | None, str]]:
    return [
        (e["on"], e["request_id"], e["phase"], e["log_level"])
        for e in logs
        if e["event"] == "event_out_of_phase"
    ]


def _errors(link: FakeLink) -> list[tuple[str, str | None]]:
    return [(e.code, e.request_id) for e in link.of(Error)]


def test_a_copy_done_inside_its_start_decodes_with_nothing_outstanding(
    side: Side, link: FakeLink, table, rt
):
    """CPU: the copy runs inside the pull's start, so RELEASE has gone when the event returns."""
    table.handoff(link, side.prefill("late", PROMPT, GREEDY))
    h = side.prefill("early", PROMPT, GREEDY)
    table.handoff(link, early(h))
    assert table.phase("link-a", "early") is Phase.AWAITING_KV and link.of(Release) == [
        Release(request_id="late", event_slot=-1)
    ]
    table.kv_ready(link, KvReady(request_id="early", first_token=h.first_token))
    assert [(s.request_id, s.phase) for s in table.sequences()] == [
        ("late", Phase.DECODING),  # not DECODING_PULL: nothing outstanding
        ("early", Phase.DECODING),
    ]
    assert len(link.of(Release)) == 2 and len(table) == 2
    assert table.drop_peer(link) == 2 and table.sequences() == []
    for rid in ["late", "early"]:
        side.producer.allocator.free(rid)


async def test_a_stream_ordered_pull_decodes_at_once_as_decoding_pull(side: Side, dlink, table, rt):
    table.handoff(dlink, side.prefill("r1", PROMPT, GREEDY))
    (seq,) = table.sequences()
    assert seq.phase is Phase.DECODING_PULL  # in the batch, its RELEASE still due
    table.abort(dlink, "r1")
    assert table.phase("link-d", "r1") is Phase.ABORTED_PULL  # the copy may still write them
    assert table.sequences() == [] and "link-d/r1" in rt.allocator
    dlink.consumer.events[0].complete()
    await dlink.consumer.drain()
    assert table.phase("link-d", "r1") is None and "link-d/r1" not in rt.allocator
    assert dlink.of(Release) == [Release(request_id="r1", event_slot=-1)]
    side.producer.allocator.free("r1")


async def test_a_transfer_without_an_event_is_pulling_until_it_lands(side: Side, rt):
    reg, fds = side.producer.register()
    consumer = LaterConsumer.open(reg, lambda n: [os.dup(fd) for fd in fds[:n]], rt.pool)
    consumer.pending = []
    link = FakeLink("link-n", consumer)
    table = DecodeRequests(rt, max_batch=8)
    try:
        table.handoff(link, side.prefill("r1", PROMPT, GREEDY))
        assert table.phase("link-n", "r1") is Phase.PULLING and len(table) == 0
        consumer.land()
        assert table.phase("link-n", "r1") is Phase.DECODING and len(table) == 1
        assert link.of(Release) == [Release(request_id="r1", event_slot=-1)]
        assert table.drop_peer(link) == 1 and table.phase("link-n", "r1") is None
    finally:
        consumer.close()
        side.producer.allocator.free("r1")
    assert rt.allocator.num_free == rt.allocator.total


async def test_a_second_handoff_of_a_held_request_is_bad_request_in_every_phase(
    side: Side, dlink, table, rt
):
    handoffs = {
        "a": early(side.prefill("a", PROMPT, GREEDY)),  # AWAITING_KV
        "d": side.prefill("d", PROMPT, GREEDY),  # DECODING_PULL: its pull outstanding
        "e": side.prefill("e", PROMPT, GREEDY),  # ABORTED_PULL once aborted: pull outstanding
    }
    for h in handoffs.values():
        table.handoff(dlink, h)
    table.abort(dlink, "e")
    before = {rid: table.phase("link-d", rid) for rid in handoffs}
    assert before == {"a": Phase.AWAITING_KV, "d": Phase.DECODING_PULL, "e": Phase.ABORTED_PULL}
    with structlog.testing.capture_logs() as logs:
        for h in handoffs.values():
            table.handoff(dlink, h)
    assert _errors(dlink) == [(ErrorCode.BAD_REQUEST, rid) for rid in handoffs]
    assert out_of_phase(logs) == [
        ("HANDOFF", "a", "awaiting_kv", "warning"),
        ("HANDOFF", "d", "decoding_pull", "warning"),
        ("HANDOFF", "e", "aborted_pull", "warning"),
    ]
    assert {rid: table.phase("link-d", rid) for rid in handoffs} == before  # nothing moved
    assert len(dlink.consumer.events) == 2  # and no pull started
    assert table.shutdown(ErrorCode.SHUTTING_DOWN, "test over") == 2  # "e" was answered
    for event in dlink.consumer.events:
        event.complete()
    await dlink.consumer.drain()
    assert sorted(r.request_id for r in dlink.of(Release)) == ["d", "e"]
    for rid in handoffs:
        side.producer.allocator.free(rid)


async def test_kv_ready_out_of_phase_is_dropped_and_logged(side: Side, dlink, table, rt):
    """Not held or ended: a race the protocol expects (info); PULLING or DECODING_PULL: its KV
    is being pulled already (warning). None is answered, and no phase moves."""
    table.handoff(dlink, early(last := side.prefill("p", PROMPT, SamplingParams(max_tokens=1))))
    table.kv_ready(dlink, KvReady(request_id="p", first_token=last.first_token))  # PULLING
    h = side.prefill("d", PROMPT, GREEDY)
    table.handoff(dlink, early(h))
    table.kv_ready(dlink, KvReady(request_id="d", first_token=h.first_token))  # DECODING_PULL
    table.handoff(dlink, early(e := side.prefill("e", PROMPT, GREEDY)))
    table.kv_ready(dlink, KvReady(request_id="e", first_token=e.first_token))
    table.abort(dlink, "e")  # ABORTED_PULL: its pull outstanding
    phases = {rid: table.phase("link-d", rid) for rid in "pde"}
    assert phases == {"p": Phase.PULLING, "d": Phase.DECODING_PULL, "e": Phase.ABORTED_PULL}
    with structlog.testing.capture_logs() as logs:
        for rid in ["nobody", "p", "d", "e"]:
            table.kv_ready(dlink, KvReady(request_id=rid, first_token=7))
    assert out_of_phase(logs) == [
        ("KV_READY", "nobody", None, "info"),
        ("KV_READY", "p", "pulling", "warning"),
        ("KV_READY", "d", "decoding_pull", "warning"),
        ("KV_READY", "e", "aborted_pull", "info"),
    ]
    assert dlink.sent == [] and len(dlink.consumer.events) == 3
    assert {rid: table.phase("link-d", rid) for rid in "pde"} == phases
    assert [s.generated for s in table.sequences()] == [[last.first_token], [h.first_token]]
    table.shutdown(ErrorCode.SHUTTING_DOWN, "test over")
    for event in dlink.consumer.events:
        event.complete()
    await dlink.consumer.drain()
    for rid in "pde":
        side.producer.allocator.free(rid)


async def test_abort_of_a_request_not_held_or_ending_is_cache_not_exist(
    side: Side, dlink, table, rt
):
    table.handoff(dlink, side.prefill("e", PROMPT, GREEDY))
    table.abort(dlink, "e")  # ABORTED_PULL: RELEASE after its pull is the answer
    with structlog.testing.capture_logs() as logs:
        table.abort(dlink, "nobody")
        table.abort(dlink, "e")
    assert _errors(dlink) == [
        (ErrorCode.CACHE_NOT_EXIST, "nobody"),
        (ErrorCode.CACHE_NOT_EXIST, "e"),
    ]
    assert out_of_phase(logs) == [
        ("ABORT", "nobody", None, "info"),
        ("ABORT", "e", "aborted_pull", "info"),
    ]
    dlink.consumer.events[0].complete()
    await dlink.consumer.drain()
    assert dlink.of(Release) == [Release(request_id="e", event_slot=-1)]  # exactly one
    assert table.phase("link-d", "e") is None
    side.producer.allocator.free("e")


def test_a_pull_done_in_a_phase_without_a_transfer_due_is_a_logged_bug_that_moves_nothing(
    side: Side, link: FakeLink, table, rt
):
    table.handoff(link, side.prefill("r1", PROMPT, GREEDY))  # CPU: copied, RELEASE, DECODING
    (seq,) = table.sequences()
    with structlog.testing.capture_logs() as logs:
        table.pull_done(seq, None)
        table.pull_done(seq, RuntimeError("a second report, failed"))
    assert out_of_phase(logs) == [("pull done", "r1", "decoding", "error")] * 2
    assert link.of(Release) == [Release(request_id="r1", event_slot=-1)] and link.of(Error) == []
    assert seq.phase is Phase.DECODING and len(table) == 1
    assert table.drop_peer(link) == 1
    side.producer.allocator.free("r1")


def test_a_step_result_for_a_sequence_not_decoding_is_a_logged_bug_and_sends_nothing(
    side: Side, link: FakeLink, table, rt
):
    table.handoff(link, early(side.prefill("r1", PROMPT, GREEDY)))
    (seq,) = table.sequences()
    with structlog.testing.capture_logs() as logs:
        table.step_done([(seq, 5)])
    assert out_of_phase(logs) == [("step result", "r1", "awaiting_kv", "error")]
    assert link.sent == [] and seq.phase is Phase.AWAITING_KV and seq.generated == []
    assert table.drop_peer(link) == 1 and "link-a/r1" not in rt.allocator
    side.producer.allocator.free("r1")


async def test_shutdown_answers_every_live_phase_and_frees_each_once_its_pull_is_done(
    side: Side, dlink, table, rt
):
    table.handoff(dlink, early(side.prefill("a", PROMPT, GREEDY)))  # AWAITING_KV
    h = side.prefill("p", PROMPT, SamplingParams(max_tokens=1))
    table.handoff(dlink, early(h))
    table.kv_ready(dlink, KvReady(request_id="p", first_token=h.first_token))  # PULLING
    table.handoff(dlink, side.prefill("d", PROMPT, GREEDY))  # DECODING_PULL
    assert table.shutdown(ErrorCode.SHUTTING_DOWN, "decode daemon is shutting down") == 3
    assert sorted(_errors(dlink)) == [(ErrorCode.SHUTTING_DOWN, rid) for rid in "adp"]
    assert table.sequences() == [] and table.phase("link-d", "a") is None  # nothing pulled
    assert {table.phase("link-d", rid) for rid in "pd"} == {Phase.ENDING_PULL}  # pulls due
    assert table.shutdown(ErrorCode.SHUTTING_DOWN, "again") == 0  # ended ones were answered
    for event in dlink.consumer.events:
        event.complete()
    await dlink.consumer.drain()
    assert sorted(r.request_id for r in dlink.of(Release)) == ["d", "p"]
    assert dlink.of(Finish) == [] and dlink.of(Tokens) == []
    for rid in "apd":
        side.producer.allocator.free(rid)


async def test_finish_reports_the_documented_timings_of_a_late_handoff(
    side: Side, link: FakeLink, table, rt
):
    table.handoff(link, sent_now(link, side.prefill("r1", PROMPT, GREEDY)))
    await decode_until(table, lambda: link.of(Finish))
    timings = link.of(Finish)[0].timings
    assert set(timings) == LATE_KEYS
    assert all(v >= 0 for v in timings.values()), timings  # each span's marks in their order
    side.producer.allocator.free("r1")


async def test_finish_reports_the_documented_timings_of_an_early_handoff(
    side: Side, link: FakeLink, table, rt
):
    h = side.prefill("r1", PROMPT, GREEDY)
    table.handoff(link, sent_now(link, early(h)))
    ready = KvReady(request_id="r1", first_token=h.first_token, sent_ns=time.monotonic_ns())
    table.kv_ready(link, ready)
    await decode_until(table, lambda: link.of(Finish))
    timings = link.of(Finish)[0].timings
    assert set(timings) == LATE_KEYS | {"first_wait_us", "first_read_us"}
    assert all(v >= 0 for v in timings.values()), timings
    side.producer.allocator.free("r1")


async def test_without_the_peers_clock_its_spans_are_absent_or_zero(
    side: Side, link: FakeLink, table, rt
):
    """A link across hosts carries no `sent_ns`: what counts from it is not measured."""
    table.handoff(link, side.prefill("r1", PROMPT, GREEDY))
    await decode_until(table, lambda: link.of(Finish))
    timings = link.of(Finish)[0].timings
    assert set(timings) == LATE_KEYS - {"read_us", "wire_us"}
    assert timings["decode_handoff_us"] == timings["usable_us"] == 0.0
    assert timings["pull_us"] >= 0 and timings["first_step_us"] > 0
    side.producer.allocator.free("r1")
