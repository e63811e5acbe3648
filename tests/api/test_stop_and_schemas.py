"""Stop strings are cut without ever emitting part of one; request fields are checked by name."""

from __future__ import annotations

import pytest

from api_server import schemas
from api_server.errors import ApiError
from api_server.generation import StopCutter


def run_cutter(stops: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    cutter, out = StopCutter(stops), []
    for d in deltas:
        text, hit = cutter.feed(d)
        out.append(text)
        if hit:
            return out, True
    out.append(cutter.flush())
    return out, False


def test_stop_across_deltas_is_cut_and_never_emitted() -> None:
    out, hit = run_cutter(["END"], ["abc E", "N", "D tail"])
    assert hit and "".join(out) == "abc " and out == ["abc ", "", ""]


def test_a_partial_match_that_fails_is_released() -> None:
    out, hit = run_cutter(["END"], ["abc EN", "x", "y"])
    assert not hit and out == ["abc ", "ENx", "y", ""]


def test_earliest_of_several_stops_wins_and_no_stop_passes_through() -> None:
    assert run_cutter(["cd", "b"], ["abcd"]) == (["a"], True)
    assert run_cutter([], ["a", "b"]) == (["a", "b", ""], False)
    assert run_cutter(["zz"], ["az", "b"]) == (["a", "zb", ""], False)


def decode(body: str) -> schemas.CompletionRequest:
    cls = schemas.ChatRequest if "messages" in body else schemas.CompletionRequest
    return schemas.decode(cls, body.encode())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"prompt": "x"}', "model"),
        ('{"model": "m", "messages": [{"content": "x"}]}', "messages[0].role"),
        ('{"model": "m", "prompt": "x", "max_tokens": "3"}', "max_tokens"),
        ('{"model": "m", "prompt": [[1, 2]]}', "prompt[0]"),
        (
            '{"model": "m", "prompt": "x", "stream_options": {"include_usage": 1}}',
            "stream_options.include_usage",
        ),
        ('{"model": "m", "prompt": "x", "echo": true}', "echo"),
        ('{"model": "m", "prompt": "x", "best_of": 2}', "best_of"),
    ],
)
def test_bad_fields_are_named(body: str, param: str) -> None:
    with pytest.raises(ApiError) as info:
        decode(body)
    assert info.value.status == 400 and info.value.body()["error"]["param"] == param


def test_prompt_forms_and_sampling_defaults() -> None:
    assert schemas.prompt_of(decode('{"model": "m", "prompt": ["hi"]}')) == ("hi", None)
    assert schemas.prompt_of(decode('{"model": "m", "prompt": [5, 6]}')) == (None, [5, 6])
    with pytest.raises(ApiError, match="one prompt per request"):
        schemas.prompt_of(decode('{"model": "m", "prompt": ["a", "b"]}'))
    req = decode('{"model": "m", "prompt": "x", "top_k": 5, "seed": 3, "stop": "\\n"}')
    params = schemas.sampling(req, max_tokens=None, default_max=16)
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (16, 1.0, 5, 3)
    assert schemas.stop_strings(req) == ["\n"]
    chat = schemas.decode(
        schemas.ChatRequest, b'{"model": "m", "messages": [], "max_completion_tokens": 0}'
    )
    with pytest.raises(ApiError) as info:
        schemas.sampling(chat, max_tokens=chat.max_completion_tokens, default_max=16)
    assert info.value.body()["error"]["param"] == "max_completion_tokens"
