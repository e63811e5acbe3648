"""The early handoff on the decode side: a HANDOFF without its first token only reserves blocks
(its KV is not written yet); the prefill's TOKENS with that token starts the pull and the
decoding; every way a request can end meanwhile (abort, a bad or unexpected TOKENS, a first
token that ends it, shutdown) frees its blocks exactly once, never under its copy, and gives the
prefill back its blocks and event slot.

Real parts as in test_deferred_pull: the tiny model's forward passes, a shared-memory producer
pool opened through a KVConsumer; the one fake is the CUDA event of a pull still in flight.
"""

from __future__ import annotations

from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import Error, ErrorCode, Finish, KvLaunched, KvReady, Release, Tokens
from decode_server.phase import Phase
from tests.support.decode import PROMPT, FakeLink, Side, decode_until, early

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


async def test_an_early_handoff_joins_on_its_first_token_and_decodes_to_the_reference(
    side: Side,
    link: FakeLink,
    table,
    rt,
):
    h = side.prefill("r1", PROMPT, GREEDY)
    table.handoff(link, early(h))
    assert link.sent == []  # reserved only: the blocks may still be written, nothing copied
    assert len(table) == 0 and [s.request_id for s in table.sequences()] == ["r1"]
    table.kv_ready(link, KvReady(request_id="r1", first_token=h.first_token))
    assert link.of(Release) == [Release(request_id="r1", event_slot=-1)]  # CPU: copied inline
    assert len(table) == 1
    await decode_until(table, lambda: link.of(Finish))
    tokens = [h.first_token] + [t for m in link.of(Tokens) for t in m.tokens]
    assert tokens == reference.generate(rt.model, PROMPT, GREEDY, block_size=rt.layout.block_size)
    assert "first_wait_us" in link.of(Finish)[0].timings
    side.producer.allocator.free("r1")


def test_an_early_handoff_names_its_blocks_while_the_prefill_computes(side: Side, link, table, rt):
    """Its pull publishes the names of its prompt's blocks; a lookup that missed computed one:
    the rest are computed at the early HANDOFF, off the way of its first token."""
    prompt = list(range(200, 214))  # 14 tokens no other test sends: 3 full blocks of 4
    table.handoff(link, early(side.prefill("r1", prompt, GREEDY)))
    (seq,) = table.sequences()
    assert rt.prefix is not None and seq.cached_blocks == 0
    assert len(seq.names) == 3 and seq.names.computed == 3
    table.abort(link, "r1")
    side.producer.allocator.free("r1")


async def test_tokens_for_a_request_that_awaits_none_are_dropped(
    side: Side,
    link: FakeLink,
    table,
    rt,
):
    table.kv_ready(link, KvReady(request_id="nobody", first_token=7))
    assert link.sent == []
    h = side.prefill("r1", PROMPT, GREEDY)
    table.handoff(link, early(h))
    table.kv_ready(link, KvReady(request_id="r1", first_token=h.first_token))
    table.kv_ready(link, KvReady(request_id="r1", first_token=h.first_token))  # a second: dropped
    assert len(table) == 1
    await decode_until(table, lambda: link.of(Finish))
    generated = [t for m in link.of(Tokens) for t in m.tokens]
    assert len(generated) == GREEDY.max_tokens - 1  # the first token counted once
    side.producer.allocator.free("r1")


def test_a_first_token_beyond_the_vocab_is_bad_request_and_frees_the_blocks(
    side: Side,
    link: FakeLink,
    table,
    rt,
):
    table.handoff(link, early(side.prefill("r1", PROMPT, GREEDY)))
    table.kv_ready(link, KvReady(request_id="r1", first_token=10**6))
    assert [(e.code, e.request_id) for e in link.of(Error)] == [(ErrorCode.BAD_REQUEST, "r1")]
    assert len(table) == 0 and table.sequences() == [] and link.of(Release) == []
    assert "link-a/r1" not in rt.allocator
    side.producer.allocator.free("r1")


def test_abort_while_awaiting_the_first_token_frees_at_once_and_answers_nothing(
    side: Side,
    dlink,
    table,
    rt,
):
    """Nothing was pulled, so the blocks go at once, and no RELEASE is due: the decode never
    waited on the event slot (the prefill reuses it without waiting for an answer)."""
    table.handoff(dlink, early(side.prefill("r1", PROMPT, GREEDY)))
    table.abort(dlink, "r1")
    assert table.sequences() == [] and "link-d/r1" not in rt.allocator
    assert dlink.sent == [] and dlink.consumer.events == []  # no pull was ever started
    table.kv_ready(dlink, KvReady(request_id="r1", first_token=5))  # late: dropped
    assert len(table) == 0 and dlink.sent == []
    side.producer.allocator.free("r1")


async def test_a_first_token_that_ends_the_request_finishes_only_after_the_pull(
    side: Side,
    dlink,
    table,
    rt,
):
    params = SamplingParams(max_tokens=1)
    h = side.prefill("r1", PROMPT, params)
    table.handoff(dlink, early(h))
    table.kv_ready(dlink, KvReady(request_id="r1", first_token=h.first_token))
    assert len(table) == 0 and dlink.sent == []  # nothing to decode, and its copy still runs
    assert dlink.consumer.pulls_in_flight == 1
    dlink.consumer.events[0].complete()
    await dlink.consumer.drain()
    assert [type(m) for m in dlink.sent] == [Release, Finish]
    assert dlink.of(Finish)[0].usage.completion_tokens == 1
    assert "link-d/r1" not in rt.allocator
    side.producer.allocator.free("r1")


async def test_the_first_step_waits_on_the_pull_of_an_early_handoff(
    side: Side,
    dlink,
    table,
    rt,
):
    h = side.prefill("r1", PROMPT, GREEDY)
    table.handoff(dlink, early(h))
    assert dlink.consumer.events == []  # the KV may not be written yet: no pull
    table.kv_ready(dlink, KvReady(request_id="r1", first_token=h.first_token))
    (event,) = dlink.consumer.events
    await decode_until(table, lambda: dlink.of(Tokens))
    assert len(event.waited_by) == 1 and event.waited_by[0].startswith("pdkv-decode-torch")
    event.complete()
    await decode_until(table, lambda: dlink.of(Finish))
    tokens = [h.first_token] + [t for m in dlink.of(Tokens) for t in m.tokens]
    assert tokens == reference.generate(rt.model, PROMPT, GREEDY, block_size=rt.layout.block_size)
    side.producer.allocator.free("r1")


def test_shutdown_reaches_a_sequence_awaiting_its_first_token(
    side: Side,
    link: FakeLink,
    table,
    rt,
):
    table.handoff(link, early(side.prefill("r1", PROMPT, GREEDY)))
    assert table.shutdown(ErrorCode.SHUTTING_DOWN, "decode daemon is shutting down") == 1
    assert [(e.code, e.request_id) for e in link.of(Error)] == [(ErrorCode.SHUTTING_DOWN, "r1")]
    assert table.sequences() == [] and "link-a/r1" not in rt.allocator
    side.producer.allocator.free("r1")


async def test_awaits_kv_while_an_early_handoff_awaits_it_and_nothing_is_to_step(
    side: Side,
    link: FakeLink,
    table,
    rt,
):
    """What bounds the decode's polling for a KV_READY (server.py): a sequence of that link
    awaits its KV and the loop has nothing to step."""
    other = FakeLink("link-b", link.consumer)
    assert not table.awaits_kv(link)
    h = side.prefill("r1", PROMPT, GREEDY)
    table.handoff(link, early(h))
    assert table.awaits_kv(link) and not table.awaits_kv(other)
    table.kv_ready(link, KvReady(request_id="r1", first_token=h.first_token))
    assert not table.awaits_kv(link)  # pulled and decoding
    h2 = side.prefill("r2", [5, 6, 7, 8, 9], GREEDY)
    table.handoff(link, early(h2))
    assert not table.awaits_kv(link)  # awaited, but r1 is to step: the loop has work
    await decode_until(table, lambda: link.of(Finish))
    assert table.awaits_kv(link)  # r1 done: only r2 left, awaiting its KV
    table.abort(link, "r2")
    assert not table.awaits_kv(link)
    side.producer.allocator.free("r1")
    side.producer.allocator.free("r2")


# ---- KV_LAUNCHED (v12) --------------------------------------------------------------------------
# On CPU the decode has no first-token buffer (and the link no mailbox): KV_LAUNCHED only marks
# the sequence launched, KV_READY starts its pull as before, and an ABORT after it is answered.


def _counts(rt) -> tuple[int, int, int, int]:  # type: ignore[no-untyped-def]
    a = rt.allocator
    return (a.total, a.num_free, a.num_owned, a.num_leased)


def test_kv_launched_for_a_request_not_held_is_dropped_without_an_answer(
    side: Side,
    link: FakeLink,
    table,
    rt,
):
    before = _counts(rt)
    table.kv_launched(link, KvLaunched(request_id="nobody", sent_ns=5))
    assert link.sent == [] and link.frames == [] and table.sequences() == []
    table.handoff(link, early(side.prefill("r1", PROMPT, GREEDY)))
    table.abort(link, "r1")  # not launched: ended with no answer, and forgotten
    table.kv_launched(link, KvLaunched(request_id="r1", sent_ns=6))  # crossed the ABORT
    assert link.sent == [] and table.sequences() == [] and len(table) == 0
    assert _counts(rt) == before
    side.producer.allocator.free("r1")


async def test_kv_launched_then_kv_ready_on_cpu_decodes_to_the_reference(
    side: Side,
    link: FakeLink,
    table,
    rt,
):
    h = side.prefill("r1", PROMPT, GREEDY)
    table.handoff(link, early(h))
    (seq,) = table.sequences()
    assert seq.phase is Phase.AWAITING_KV
    table.kv_launched(link, KvLaunched(request_id="r1", sent_ns=1))
    assert seq.phase is Phase.AWAITING_READY  # CPU: nothing starts on it
    assert link.sent == [] and len(table) == 0  # still awaiting its KV
    assert table.launched_first == 0
    table.kv_ready(link, KvReady(request_id="r1", first_token=h.first_token))
    assert link.of(Release) == [Release(request_id="r1", event_slot=-1)]  # pulled inline
    assert len(table) == 1
    table.kv_launched(link, KvLaunched(request_id="r1", sent_ns=2))  # decoding: dropped
    assert [type(m) for m in link.sent] == [Release]
    await decode_until(table, lambda: link.of(Finish))
    tokens = [h.first_token] + [t for m in link.of(Tokens) for t in m.tokens]
    assert tokens == reference.generate(rt.model, PROMPT, GREEDY, block_size=rt.layout.block_size)
    assert len(link.of(Release)) == 1 and link.of(Error) == []
    timings = link.of(Finish)[0].timings
    assert "first_wait_us" in timings  # KV_READY started it, as after any early HANDOFF
    assert "launch_lead_us" not in timings  # its pull did not start on KV_LAUNCHED
    assert table.launched_first == 0
    side.producer.allocator.free("r1")


def test_abort_after_kv_launched_answers_one_release_and_frees_the_blocks(
    side: Side,
    dlink,
    table,
    rt,
):
    """P may have queued the slot's record: after KV_LAUNCHED it waits for our answer to an
    ABORT before it reuses the slot. No pull started here, so RELEASE goes at once; a request
    aborted without KV_LAUNCHED still gets no answer."""
    before = _counts(rt)
    launched = early(side.prefill("r1", PROMPT, GREEDY))  # CPU: no event ring, slot -1
    plain = early(side.prefill("r2", [5, 6, 7, 8, 9], GREEDY))
    table.handoff(dlink, launched)
    table.handoff(dlink, plain)
    assert _counts(rt)[1] < before[1]  # both hold decode blocks
    table.kv_launched(dlink, KvLaunched(request_id="r1", sent_ns=3))
    table.kv_launched(dlink, KvLaunched(request_id="r1", sent_ns=4))  # a repeat: one answer
    assert dlink.sent == []
    table.abort(dlink, "r1")
    assert dlink.sent == [Release(request_id="r1", event_slot=-1)]  # its slot echoed
    assert [s.request_id for s in table.sequences()] == ["r2"]
    assert "link-d/r1" not in rt.allocator and "link-d/r2" in rt.allocator
    table.abort(dlink, "r2")  # no KV_LAUNCHED: P reuses the slot without an answer
    assert dlink.sent == [Release(request_id="r1", event_slot=-1)]
    assert table.sequences() == [] and dlink.consumer.events == []  # nothing was pulled
    assert _counts(rt) == before
    table.kv_ready(dlink, KvReady(request_id="r1", first_token=5))  # late: dropped
    table.kv_launched(dlink, KvLaunched(request_id="r2", sent_ns=5))  # late: dropped
    assert len(dlink.sent) == 1 and len(table) == 0
    side.producer.allocator.free("r1")
    side.producer.allocator.free("r2")
