"""Structured output through the HTTP API with the tiny model (issue 42): response_format
json_schema on chat and completions, vLLM's structured_outputs object and guided_* fields, the official openai client's
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


def test_structured_outputs_object_asks_what_each_old_field_asked(stack: Stack) -> None:
    """vLLM >= 0.10's `structured_outputs` keys constrain as the guided_* field of the same
    kind did: greedy, the same text token for token, on both endpoints."""
    api = stack.api.sync_client()
    same = [
        ({"choice": ["left", "right"]}, {"guided_choice": ["left", "right"]}),
        ({"regex": "[0-9]{3}"}, {"guided_regex": "[0-9]{3}"}),
        ({"json": SCHEMAS[2]}, {"guided_json": SCHEMAS[2]}),
        ({"json": json.dumps(SCHEMAS[4])}, {"guided_json": SCHEMAS[4]}),
        ({"grammar": 'start: "ab" | "cd"'}, {"guided_grammar": 'start: "ab" | "cd"'}),
        (
            {"json_object": True, "disable_fallback": True},
            {"response_format": {"type": "json_object"}},
        ),
    ]
    for new, old in same:
        base = dict(model="pdkv-tiny", prompt="pick:", max_tokens=60, temperature=0)
        got = api.completions.create(**base, extra_body={"structured_outputs": new})
        want = api.completions.create(**base, extra_body=old)
        assert got.choices[0].text == want.choices[0].text, new
        assert got.choices[0].finish_reason == "stop", (new, got.choices[0].text)
        chat = dict(model="pdkv-tiny", messages=CHAT, max_tokens=60, temperature=0)
        got = api.chat.completions.create(**chat, extra_body={"structured_outputs": new})
        want = api.chat.completions.create(**chat, extra_body=old)
        assert got.choices[0].message.content == want.choices[0].message.content, new
    # nothing asked (only options, json_object false): free text, as without the object
    base = dict(model="pdkv-tiny", prompt="pick:", max_tokens=12, temperature=0)
    free = api.completions.create(**base).choices[0].text
    for nothing in ({}, {"json_object": False, "disable_any_whitespace": True}):
        got = api.completions.create(**base, extra_body={"structured_outputs": nothing})
        assert got.choices[0].text == free


def test_disable_additional_properties_closes_the_objects(stack: Stack) -> None:
    """An open schema with disable_additional_properties answers as the same schema closed
    by hand, and the answer has no key the schema does not name."""
    api = stack.api.sync_client()
    inner = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}
    schema = {"type": "object", "properties": {"a": inner}, "required": ["a"]}
    closed = {
        "type": "object",
        "properties": {"a": {**inner, "additionalProperties": False}},
        "required": ["a"],
        "additionalProperties": False,
    }
    base = dict(model="pdkv-tiny", prompt="JSON:", max_tokens=100, temperature=0)
    asked = {"json": schema, "disable_additional_properties": True}
    got = api.completions.create(**base, extra_body={"structured_outputs": asked})
    want = api.completions.create(**base, extra_body={"structured_outputs": {"json": closed}})
    assert got.choices[0].text == want.choices[0].text
    jsonschema.validate(json.loads(got.choices[0].text), closed)
    # left open, the tiny model's greedy answer goes on with a key of its own after "x"
    free = api.completions.create(**base, extra_body={"structured_outputs": {"json": schema}})
    assert free.choices[0].text.startswith(got.choices[0].text[:-2] + ", ")


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
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs.choice",
            "structured_outputs.regex and structured_outputs.choice",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
            "give one of them",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
            "guided_choice",
            "give one of them",
        ),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "no field 'jsn'"),
        (
            {"structured_outputs": {"json": {"type": "nonsense"}}},
            "structured_outputs.json",
            "nonsense",
        ),
        ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex", "regex"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice", "non-empty list"),
        ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object", "boolean"),
        (
            {"structured_outputs": {"regex": "a", "disable_fallback": "yes"}},
            "structured_outputs.disable_fallback",
            "boolean",
        ),
        (
            {"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs.structural_tag",
            "not supported",
        ),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
            "not supported",
        ),
        ({"structured_outputs": ["regex"]}, "structured_outputs", "object"),
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
    codes = ("invalid_structured_output", "invalid_value", "unsupported_parameter")
    assert info.value.body["code"] in codes
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


def test_disable_additional_properties_reaches_every_nested_object() -> None:
    """Objects under properties, items, anyOf and $defs are closed; an object that says
    additionalProperties keeps its word, and a property named "properties" is a name."""
    from types import SimpleNamespace

    from api_server.structured import structured_of

    obj = {"type": "object", "properties": {"v": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {
            "list": {"type": "array", "items": obj},
            "either": {"anyOf": [obj, {"type": "null"}]},
            "ref": {"$ref": "#/$defs/d"},
            "properties": {"type": "string"},
        },
        "$defs": {"d": {**obj, "additionalProperties": True}},
    }
    req = SimpleNamespace(
        structured_outputs={"json": schema, "disable_additional_properties": True}
    )
    got = json.loads(structured_of(req).spec)
    assert got["additionalProperties"] is False
    assert got["properties"]["list"]["items"]["additionalProperties"] is False
    assert got["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"]["either"]["anyOf"][1]
    assert got["$defs"]["d"]["additionalProperties"] is True
    assert got["properties"]["properties"] == {"type": "string"}
    req.structured_outputs = {"json": schema}
    assert json.loads(structured_of(req).spec) == schema


def _warm_lines(text: str) -> list[dict]:
    lines = (json.loads(x) for x in text.splitlines() if x.startswith("{"))
    return [x for x in lines if x.get("event") in ("grammars_warmed", "grammar_warm_failed")]


def test_every_process_builds_its_grammar_cache_once_before_constrained_requests(
    stack: Stack,
) -> None:
    """The grammar library's view of the tokenizer is built when each process learns its model
    (common.structured.warm): the API, the prefill and the decode each log it once, however many
    constrained requests came (a build per request, or none, fails here)."""
    client = stack.api.sync_client()
    for i in range(2):
        out = client.chat.completions.create(
            model="pdkv-tiny",
            messages=[{"role": "user", "content": f"warm {i}"}],
            max_tokens=40,
            temperature=0,
            extra_body={"guided_choice": ["yes", "no"]},
        )
        assert out.choices[0].message.content in ("yes", "no")
    logs = {
        "api": stack.api.log.read_text(),
        "prefill": stack.pair.daemons["prefill"].log_text(),
        "decode": stack.pair.daemons["decode"].log_text(),
    }
    for role, text in logs.items():
        lines = _warm_lines(text)
        assert [(x["event"], x["role"]) for x in lines] == [("grammars_warmed", role)], lines
