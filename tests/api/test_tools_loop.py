"""A tool-calling loop with the official openai client against the real stack: the model calls a
function (tool_choice names it, or `required`), the app answers with a `tool` message, the model
answers. The random model calls nothing by itself: these choices are forced by the grammar over
the tools' schemas (SamplingParams.structured, enforced by the prefill's first token and the
decode's step), so they pass only where the grammar enforcement is merged (issue 42 item 2)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from tests.support.api import Stack, openai
from tests.support.tool_checkpoint import MODEL, TOOLS, WEATHER, hf_ids

SCHEMAS = {
    t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def streamed_calls(chunks: Iterator) -> tuple[str, list[dict], str | None]:
    """(content, calls as {id, name, arguments}, finish reason) of a streamed answer."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                if part.id is not None:
                    calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
                calls[part.index]["arguments"] += part.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, list(calls.values()), reason


def test_a_named_call_a_tool_result_and_the_answer(qwen: Stack, ckpt: Path) -> None:
    api = qwen.api.sync_client()
    messages: list = [{"role": "user", "content": "Weather in Paris?"}]
    first = api.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=NAMED, max_tokens=64, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})})
    answer = api.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.tool_calls is None
    assert isinstance(answer.choices[0].message.content, str)
    history = [{**m, "content": m.get("content")} for m in messages]
    assert answer.usage.prompt_tokens == len(hf_ids(ckpt, history, TOOLS))
    st = qwen.wait_idle()
    assert all(s.inflight == 0 and s.pool["free"] == s.pool["total"] for s in st.values())


def test_a_named_call_streams_as_it_answers_whole(qwen: Stack) -> None:
    api = qwen.api.sync_client()
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=64,
        temperature=0,
    )
    whole = api.chat.completions.create(**kw).choices[0]
    content, calls, reason = streamed_calls(api.chat.completions.create(**kw, stream=True))
    assert content == "" and reason == whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_one_of_the_tools_with_valid_arguments(
    qwen: Stack,
    parallel: bool,
) -> None:
    api = qwen.api.sync_client()
    content, calls, reason = streamed_calls(
        api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Help."}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=96,
            temperature=0,
            stream=True,
        )
    )
    assert reason == "tool_calls" and content == ""
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_response_format_with_a_forced_call_is_refused(qwen: Stack) -> None:
    """Two constraints on one answer: 400 before the daemons hold anything."""
    api = qwen.api.sync_client()
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert info.value.body["param"] == "response_format"
    assert "tool_choice" in info.value.body["message"]
    st = qwen.wait_idle()
    assert all(s.inflight == 0 and s.pool["free"] == s.pool["total"] for s in st.values())
