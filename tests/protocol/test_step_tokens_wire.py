"""STEP_TOKENS (v10) on the wire: its lists must agree and are bounded when read, and it stands
for its entries' TOKENS, then its FINISHes, in order."""

from __future__ import annotations

import pytest

from common.errors import ProtocolError
from common.protocol import MAX_STEP_ENTRIES, Finish, StepTokens, Tokens, Usage, decode, encode
from common.protocol.frame import HEADER, HEADER_SIZE
from common.sampling_params import TokenLogprob


def _reframe(frame: bytes, meta: bytes) -> bytes:
    """`frame`'s header with `meta` as its metadata (lengths fixed)."""
    magic, version, mtype, *_ = HEADER.unpack(frame[:HEADER_SIZE])
    return HEADER.pack(magic, version, mtype, len(meta), 0, 0) + meta


def test_frames_are_the_entries_tokens_then_the_finishes() -> None:
    lp = TokenLogprob(9, -0.5, [(9, -0.5)])
    end = Finish(request_id="a", reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=2))
    msg = StepTokens(
        request_ids=["a", "b", "a"], tokens=[1, 2, 9], logprobs=[None, None, lp], finishes=[end]
    )
    assert decode(encode(msg)) == msg
    assert list(msg.frames()) == [
        Tokens(request_id="a", tokens=[1]),
        Tokens(request_id="b", tokens=[2]),
        Tokens(request_id="a", tokens=[9], logprobs=[lp]),
        end,
    ]


@pytest.mark.parametrize(
    "meta",
    [
        b'{"request_ids":["a","b"],"tokens":[1]}',
        b'{"request_ids":["a"],"tokens":[1],"logprobs":[null,null]}',
        b'{"request_ids":["a"],"tokens":[-1]}',
        b'{"request_ids":[""],"tokens":[1]}',
    ],
    ids=["tokens-count", "logprobs-count", "negative-token", "empty-id"],
)
def test_lists_that_disagree_or_are_out_of_range_are_refused(meta: bytes) -> None:
    frame = _reframe(encode(StepTokens(request_ids=[], tokens=[])), meta)
    with pytest.raises(ProtocolError, match="invalid STEP_TOKENS"):
        decode(frame)


def test_more_entries_than_a_frame_may_hold_are_refused_when_read() -> None:
    n = MAX_STEP_ENTRIES + 1
    ids = ",".join(['"r"'] * n)
    meta = f'{{"request_ids":[{ids}],"tokens":[{",".join(["1"] * n)}]}}'.encode()
    frame = _reframe(encode(StepTokens(request_ids=[], tokens=[])), meta)
    with pytest.raises(ProtocolError, match="invalid STEP_TOKENS"):
        decode(frame)
    ok = StepTokens(request_ids=["r"] * MAX_STEP_ENTRIES, tokens=[1] * MAX_STEP_ENTRIES)
    assert decode(encode(ok)) == ok
