"""The decode's side of structured output, without processes: a HANDOFF whose spec does not
compile is refused before any block is taken; the matcher is rebuilt from the HANDOFF's spec
and first token, every step draws under its mask, and the sequence ends ("stop") once the
grammar's text is complete, before max_tokens and without an EOS token."""

from __future__ import annotations

import msgspec

from common.protocol import Error, ErrorCode, Finish, Release, Tokens
from common.sampling_params import SamplingParams, StructuredOutput
from tests.support.decode import FakeLink, Side, decode_until


def _with(h, **fields):  # type: ignore[no-untyped-def]
    return msgspec.structs.replace(h, **fields)


def test_a_spec_that_does_not_compile_is_refused_without_taking_blocks(
    side: Side, link: FakeLink, table, rt
) -> None:  # type: ignore[no-untyped-def]
    h = side.prefill("g", [1, 2, 3, 4, 5], SamplingParams(max_tokens=6))
    bad = SamplingParams(max_tokens=6, structured=StructuredOutput("regex", "(["))
    free = rt.allocator.num_free
    table.handoff(link, _with(h, sampling=bad))
    errors = [(e.code, e.request_id, e.message) for e in link.of(Error)]
    assert [(c, r) for c, r, _ in errors] == [(ErrorCode.BAD_REQUEST, "g")]
    assert "structured regex does not compile" in errors[0][2]
    assert link.of(Release) == [] and len(table) == 0 and rt.allocator.num_free == free
    side.producer.allocator.free("g")


async def test_steps_follow_the_grammar_from_the_handoffs_first_token(
    side: Side, link: FakeLink, table, rt
) -> None:  # type: ignore[no-untyped-def]
    spec = SamplingParams(max_tokens=20, structured=StructuredOutput("regex", "ab{3}c"))
    h = side.prefill("g2", [7, 8, 9], SamplingParams(max_tokens=20))
    table.handoff(link, _with(h, sampling=spec, first_token=ord("a")))
    await decode_until(table, lambda: link.of(Finish))
    tokens = [t for m in link.of(Tokens) for t in m.tokens]
    assert bytes(tokens) == b"bbbc"
    finish = link.of(Finish)[0]
    assert finish.reason == "stop" and finish.usage.completion_tokens == 5
    side.producer.allocator.free("g2")
