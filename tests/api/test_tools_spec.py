"""The constraint each tool_choice asks the grammar for (checked against jsonschema: it admits
exactly the calls OpenAI's tool_choice allows), the parser each template and --tool-parser give
`auto`, and the history as templates see it."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from api_server.errors import ApiError
from api_server.schemas import ChatMessage
from api_server.tools.history import template_messages
from api_server.tools.parsers import Forced, Hermes, Llama3Json, Mistral
from api_server.tools.plan import constrained, plan
from api_server.tools.spec import tool_request
from common.sampling_params import SamplingParams, StructuredOutput
from tests.support.tool_checkpoint import TEMPLATE

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "now"}},
]
USER = [{"role": "user", "content": "hi"}]


def schema_of(choice, parallel=None) -> dict:
    structured = tool_request(TOOLS, choice, parallel).structured()
    assert structured is not None and structured.kind == "json_schema"
    return json.loads(structured.spec)


def valid(schema: dict, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_a_named_choice_is_its_parameters_schema() -> None:
    schema = schema_of({"type": "function", "function": {"name": "weather"}})
    assert schema == CITY
    now = schema_of({"type": "function", "function": {"name": "now"}})
    assert valid(now, {}) and not valid(now, [])  # no parameters: an object


@pytest.mark.parametrize("parallel", [False, True, None])
def test_required_admits_calls_of_the_tools_and_nothing_else(parallel: bool | None) -> None:
    schema = schema_of("required", parallel)
    one = [{"name": "weather", "parameters": {"city": "Rome"}}]
    two = [*one, {"name": "now", "parameters": {}}]
    assert valid(schema, one)
    assert valid(schema, two) == (parallel is not False)  # OpenAI's default: parallel
    for bad in (
        [],
        [{"name": "weather", "parameters": {}}],  # city is required
        [{"name": "other", "parameters": {}}],
        [{"name": "now"}],
        {"name": "now", "parameters": {}},
    ):
        assert not valid(schema, bad), bad


def test_auto_and_none_ask_for_no_constraint() -> None:
    assert tool_request(TOOLS, "auto", None).structured() is None
    assert tool_request(TOOLS, None, None).choice == "auto"
    assert tool_request(None, None, None).choice == "none"
    assert tool_request(TOOLS, "none", None).structured() is None


def test_plan_picks_the_parser() -> None:
    req = tool_request(TOOLS, None, None)
    assert isinstance(plan(req, USER, TEMPLATE, None).parser(), Hermes)
    assert isinstance(plan(req, USER, TEMPLATE, "mistral").parser(), Mistral)
    generic = "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0].content }}"
    with pytest.raises(ApiError) as info:
        plan(req, USER, generic, None)
    assert info.value.param == "tool_choice" and "--tool-parser" in info.value.message
    assert isinstance(plan(req, USER, generic, "llama3_json").parser(), Llama3Json)
    named = tool_request(TOOLS, {"type": "function", "function": {"name": "now"}}, None)
    forced = plan(named, USER, generic, None).parser()
    assert isinstance(forced, Forced) and forced.function == "now"
    assert plan(tool_request(TOOLS, "none", None), USER, generic, None).parser is None


def test_parallel_tool_calls_false_keeps_one_call_of_auto() -> None:
    one = plan(tool_request(TOOLS, "auto", False), USER, TEMPLATE, None).assembler()
    assert one is not None and one.max_calls == 1
    many = plan(tool_request(TOOLS, "auto", None), USER, TEMPLATE, None).assembler()
    assert many is not None and many.max_calls is None
    with pytest.raises(ApiError) as info:
        tool_request([TOOLS[1]] * 129, None, None)
    assert info.value.param == "tools" and "at most 128" in info.value.message


def test_mistral_templates_get_the_short_ids_they_demand_back() -> None:
    mistral = "{{ '[TOOL_CALLS]' }}{% if tools %}{% endif %}"
    for choice in ("auto", "required"):
        asm = plan(tool_request(TOOLS, choice, None), USER, mistral, None).assembler()
        assert asm is not None
        (header,) = asm.feed('[{"name": "now", "parameters": {}}]')[0]["tool_calls"]
        assert len(header["id"]) == 9 and header["id"].isalnum()
    asm = plan(tool_request(TOOLS, "auto", None), USER, TEMPLATE, None).assembler()
    assert asm is not None
    (header,) = asm.feed('<tool_call>{"name": "now"')[0]["tool_calls"]
    assert header["id"].startswith("call_") and len(header["id"]) == 29


def test_a_second_constraint_is_refused() -> None:
    tools = plan(tool_request(TOOLS, "required", None), USER, TEMPLATE, None)
    params = SamplingParams()
    assert constrained(params, tools, "response_format").structured == tools.structured
    with_format = msgspec.structs.replace(params, structured=StructuredOutput("json_object"))
    for field in ("response_format", "structured_outputs.json_object", "guided_json"):
        with pytest.raises(ApiError) as info:
            constrained(with_format, tools, field)
        assert info.value.param == field and field in info.value.message
    auto = plan(tool_request(TOOLS, "auto", None), USER, TEMPLATE, None)
    assert constrained(with_format, auto, "response_format") is with_format


def test_history_gives_templates_objects_and_names() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    msgs = [
        ChatMessage(role="user", content="time?"),
        ChatMessage(role="assistant", tool_calls=[call]),
        ChatMessage(role="tool", tool_call_id="c1", content=[{"type": "text", "text": "noon"}]),
    ]
    out = template_messages(msgs)
    assert out[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "now", "arguments": {}}}
        ],
    }
    assert out[2] == {"role": "tool", "content": "noon", "tool_call_id": "c1", "name": "now"}
    with pytest.raises(ApiError) as info:  # the call comes after its result
        template_messages([msgs[0], msgs[2], msgs[1]])
    assert info.value.param == "messages[1].tool_call_id"
    with pytest.raises(ApiError) as info:
        template_messages([ChatMessage(role="user", content="x", tool_calls=[call])])
    assert info.value.param == "messages[0].tool_calls"
