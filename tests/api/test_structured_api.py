"""Structured output through the HTTP API with the tiny model (issue 42): response_format
json_schema on chat and completions, vLLM's guided_* fields, the official openai client's
`parse` with a Pydantic model, refusals (a schema that does not compile, two constraints, an
unknown format) as 400s that name the field before any daemon sees the request, and /metrics."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pydantic
import pytest

from tests.support.api import Stack, metrics, openai
from tests.support.schemas import SCHEMAS

CHAT = [{"role": "user", "content": "give me JSON"}]


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


class Item(pydantic.BaseModel):
    size: Literal["S", "M", "L"]
    qty: int = pydantic.Field(ge=1, le=9)
    gift: bool


def test_chat_and_completions_answer_under_a_schema(stack: Stack) -> None:
    api = stack.api.sync_client()
    for schema in (SCHEMAS[1], SCHEMAS[4], SCHEMAS[16]):
        chat = api.chat.completions.create(
            model="pdkv-tiny",
            messages=CHAT,
            max_tokens=200,
            temperature=0.7,
            seed=1,
            response_format=_schema_format(schema),
        )
        assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
        done = api.completions.create(
            model="pdkv-tiny",
            prompt="JSON:",
            max_tokens=200,
            extra_body={"response_format": _schema_format(schema)},
        )
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].text), schema)


def test_streamed_answer_under_a_schema(stack: Stack) -> None:
    api = stack.api.sync_client()
    schema = SCHEMAS[13]
    chunks = api.chat.completions.create(
        model="pdkv-tiny",
        messages=CHAT,
        max_tokens=200,
        response_format=_schema_format(schema),
        stream=True,
        n=2,
        seed=5,
        temperature=1.0,
    )
    texts, reasons = ["", ""], [None, None]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_guided_fields(stack: Stack) -> None:
    api = stack.api.sync_client()
    base = dict(model="pdkv-tiny", prompt="pick:", max_tokens=40)
    choice = api.completions.create(**base, extra_body={"guided_choice": ["left", "right"]})
    assert choice.choices[0].text in ("left", "right")
    regex = api.completions.create(**base, extra_body={"guided_regex": "[0-9]{3}"})
    assert len(regex.choices[0].text) == 3 and regex.choices[0].text.isdigit()
    js = api.completions.create(**base, extra_body={"guided_json": json.dumps(SCHEMAS[2])})
    assert isinstance(json.loads(js.choices[0].text)["ok"], bool)


def test_openai_parse_returns_the_pydantic_object(stack: Stack) -> None:
    api = stack.api.sync_client()
    parse = getattr(api.chat.completions, "parse", None) or api.beta.chat.completions.parse
    for seed in range(3):
        done = parse(
            model="pdkv-tiny",
            messages=CHAT,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            response_format=Item,
        )
        item = done.choices[0].message.parsed
        assert isinstance(item, Item) and 1 <= item.qty <= 9, done.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"response_format": _schema_format({"type": "nonsense"})}, "response_format", "nonsense"),
        (
            {"response_format": _schema_format({"type": "string", "pattern": "(["})},
            "response_format",
            "regex",
        ),
        ({"guided_regex": "(["}, "guided_regex", "regex"),
        ({"guided_json": {"type": "nonsense"}}, "guided_json", "nonsense"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "give one of them",
        ),
    ],
)
def test_refusals_name_the_field_and_hold_nothing(
    stack: Stack, extra: dict, param: str, says: str
) -> None:
    api = stack.api.sync_client()
    before = {r: s.served for r, s in stack.statuses().items()}
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model="pdkv-tiny", messages=CHAT, max_tokens=8, extra_body=extra
        )
    assert info.value.body["param"] == param
    assert says in info.value.body["message"]
    # the API's own codes: the daemons' refusal would say bad_request
    assert info.value.body["code"] in ("invalid_structured_output", "invalid_value")
    st = stack.wait_idle()
    assert all(s.inflight == 0 and s.pool["free"] == s.pool["total"] for s in st.values())
    assert {r: s.served for r, s in st.items()} == before


def test_metrics_count_constrained_requests_and_compiles(stack: Stack) -> None:
    api = stack.api.sync_client()
    fmt = _schema_format({"type": "object", "properties": {"n": {"enum": [1, 2]}}})
    for _ in range(2):  # the second finds it compiled
        api.chat.completions.create(
            model="pdkv-tiny", messages=CHAT, max_tokens=30, response_format=fmt
        )
    m = metrics(stack)
    assert m["pdkv_api_structured_requests_total{kind=json_schema}"] >= 2
    assert m["pdkv_api_grammar_compile_seconds_count{}"] >= 1
    assert m["pdkv_api_grammar_compile_seconds_sum{}"] > 0
