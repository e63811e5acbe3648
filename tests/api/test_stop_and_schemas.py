"""Stop strings are cut without ever emitting part of one; request fields are checked by name."""

from __future__ import annotations

import pytest

from api_server import schemas
from api_server.errors import ApiError
from api_server.generation import StopCutter
from api_server.prompts import Prompt, check_context, prompts_of


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
        ('{"model": "m", "prompt": [[1, "a"]]}', "prompt[0][1]"),
        (
            '{"model": "m", "prompt": "x", "stream_options": {"include_usage": 1}}',
            "stream_options.include_usage",
        ),
        ('{"model": "m", "prompt": "x", "suffix": "y"}', "suffix"),
        ('{"model": "m", "prompt": "x", "best_of": 2}', "best_of"),
        ('{"model": "m", "prompt": "x", "n": 0}', "n"),
        ('{"model": "m", "messages": [], "top_logprobs": 2}', "top_logprobs"),
        ('{"model": "m", "prompt": "x", "logit_bias": {"5": 1}}', "logit_bias"),
    ],
)
def test_bad_fields_are_named(body: str, param: str) -> None:
    with pytest.raises(ApiError) as info:
        decode(body)
    assert info.value.status == 400 and info.value.body()["error"]["param"] == param


def test_neutral_values_of_refused_fields_and_a_body_of_the_wrong_shape() -> None:
    body = (
        '{"model": "m", "messages": [], "presence_penalty": 0, "frequency_penalty": 0.0, '
        '"logit_bias": {}, "response_format": {"type": "text"}, "user": "u", "store": false}'
    )
    assert decode(body).presence_penalty == 0
    with pytest.raises(ApiError) as info:
        schemas.decode(schemas.CompletionRequest, b"[1, 2]")
    assert "param" not in info.value.body()["error"]  # the body, not a field: no param


def test_prompt_forms_and_sampling_defaults() -> None:
    def forms(body: str) -> list[Prompt]:
        return prompts_of(decode(body).prompt)

    assert forms('{"model": "m", "prompt": "hi"}') == [Prompt(text="hi")]
    assert forms('{"model": "m", "prompt": ["a", "b"]}') == [Prompt(text="a"), Prompt(text="b")]
    assert forms('{"model": "m", "prompt": [5, 6]}') == [Prompt(tokens=[5, 6])]
    assert forms('{"model": "m", "prompt": [[5], [6, 7]]}') == [
        Prompt(tokens=[5]),
        Prompt(tokens=[6, 7]),
    ]
    for bad, param in (("[]", "prompt"), ('["a", 5]', "prompt"), ("[[5], []]", "prompt[1]")):
        with pytest.raises(ApiError) as info:
            forms(f'{{"model": "m", "prompt": {bad}}}')
        assert info.value.body()["error"]["param"] == param, bad
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


def test_context_length_blames_the_field_at_fault() -> None:
    check_context([Prompt(tokens=[1] * 10)], 22, 32, "max_tokens")  # fits exactly
    cases = [  # prompts, max_tokens, the request's name for it, the param blamed
        ([Prompt(tokens=[1] * 10)], 23, "max_tokens", "max_tokens"),
        ([Prompt(tokens=[1] * 32)], 1, "max_tokens", "prompt"),
        ([Prompt(text="x")], 32, "max_completion_tokens", "max_completion_tokens"),
    ]
    for prompts, max_tokens, name, param in cases:
        with pytest.raises(ApiError) as info:
            check_context(prompts, max_tokens, 32, name)
        error = info.value.body()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param
        assert "32 tokens" in error["message"], error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ('"presence_penalty": 2.5', "presence_penalty"),
        ('"frequency_penalty": -3', "frequency_penalty"),
        ('"repetition_penalty": 0', "repetition_penalty"),
        ('"min_tokens": -1', "min_tokens"),
        ('"stop_token_ids": [-4]', "stop_token_ids"),
        ('"logprobs": 21', "logprobs"),
        ('"max_tokens": 0', "max_tokens"),  # 0 only with echo (prompt logprobs)
    ],
)
def test_sampling_fields_out_of_range_are_named(fields: str, param: str) -> None:
    req = decode(f'{{"model": "m", "prompt": "x", {fields}}}')
    with pytest.raises(ApiError) as info:
        schemas.sampling(req, max_tokens=req.max_tokens, default_max=16)
    assert info.value.body()["error"]["param"] == param


def test_sampling_fields_reach_the_daemons_parameters() -> None:
    req = decode(
        '{"model": "m", "prompt": "x", "echo": true, "logprobs": 3, "max_tokens": 0, '
        '"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, '
        '"min_tokens": 2, "stop_token_ids": [7, 9], "seed": 4}'
    )
    p = schemas.sampling(req, max_tokens=req.max_tokens, default_max=16)
    assert (p.max_tokens, p.logprobs, p.prompt_logprobs) == (0, 3, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1, 1.2)
    assert (p.min_tokens, p.stop_token_ids) == (2, (7, 9))
    assert [schemas.seeded(p, j).seed for j in range(3)] == [4, 5, 6]
    echo_only = decode('{"model": "m", "prompt": "x", "echo": true, "max_tokens": 0}')
    p = schemas.sampling(echo_only, max_tokens=0, default_max=16)
    assert (p.logprobs, p.prompt_logprobs) == (None, 0)  # the prompt's tokens, no logprobs shown
    chat = schemas.decode(
        schemas.ChatRequest,
        b'{"model": "m", "messages": [], "logprobs": true, "top_logprobs": 5}',
    )
    p = schemas.sampling(chat, max_tokens=None, default_max=16)
    assert (p.logprobs, p.prompt_logprobs) == (5, None)
