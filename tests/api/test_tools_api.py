"""Tool calling through the real stack (daemons + API process), without a grammar: tools and a
tool-calling history rendered by Qwen2.5's template exactly as transformers renders them, the
answer read by the hermes parser the template implies (whole and streamed alike), tool_choice
none, and every malformed tool request refused with OpenAI's error shape before the daemons hold
anything. The grammar-forced choices (required, a named function) are in test_tools_loop.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from api_server.tools.assembler import ToolAssembler, fold
from api_server.tools.parsers import Hermes
from common import client
from common.sampling_params import SamplingParams
from tests.support.api import Stack, metrics, openai
from tests.support.tool_checkpoint import (
    MODEL,
    TOOLS,
    hf_ids,
    logprob_entries,
    streamed_entries,
)

transformers = pytest.importorskip("transformers")

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def reference(stack: Stack, ids: list[int], max_tokens: int) -> tuple[str, str]:
    """(text, finish reason) of a greedy request with `ids` straight to the prefill's socket."""
    params = SamplingParams(max_tokens=max_tokens)
    res = asyncio.run(client.generate(stack.pair.client_socket, sampling=params, prompt_tokens=ids))
    assert res.finish is not None
    return res.text, "length" if res.finish.reason == "length" else "stop"


def hermes_reading(text: str, reason: str) -> tuple[dict, str]:
    asm = ToolAssembler(Hermes())
    deltas = asm.feed(text)
    last, finish = asm.finish(reason)
    return fold(deltas + last), finish


def without_ids(message: dict) -> dict:
    calls = [{**c, "id": "-"} for c in message.get("tool_calls") or []]
    return {"content": message.get("content"), "tool_calls": calls}


def test_tools_and_a_tool_history_render_as_transformers_and_auto_reads_the_answer(
    qwen: Stack, ckpt: Path
) -> None:
    api = qwen.api.sync_client()
    ids = hf_ids(ckpt, HISTORY, TOOLS)
    assert len(ids) > 700  # the tools' system prompt and the call and its result are in it
    r = api.chat.completions.create(
        model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=12, temperature=0
    )
    assert r.usage.prompt_tokens == len(ids)
    text, reason = reference(qwen, ids, 12)
    message, finish = hermes_reading(text, reason)
    got = r.choices[0].message.model_dump()
    assert without_ids(got) == without_ids(message)
    assert r.choices[0].finish_reason == finish
    assert qwen.wait_idle()["prefill"].inflight == 0


def test_streamed_tool_answers_add_up_to_the_whole_one(qwen: Stack) -> None:
    api = qwen.api.sync_client()
    kw = dict(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=16, temperature=0)
    whole = api.chat.completions.create(**kw)
    content, calls, reasons = "", {}, []
    for chunk in api.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                if part.id is not None:
                    calls[part.index] = {"name": part.function.name, "arguments": ""}
                calls[part.index]["arguments"] += part.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    message = whole.choices[0].message
    assert content == (message.content or "")
    assert list(calls.values()) == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]
    assert reasons == [whole.choices[0].finish_reason]


def test_tool_choice_none_renders_the_tools_and_reads_nothing(qwen: Stack, ckpt: Path) -> None:
    api = qwen.api.sync_client()
    ids = hf_ids(ckpt, HISTORY, TOOLS)
    r = api.chat.completions.create(
        model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0
    )
    assert r.usage.prompt_tokens == len(ids)
    text, _ = reference(qwen, ids, 12)
    assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None
    plain = api.chat.completions.create(
        model=MODEL, messages=HISTORY[:2], max_tokens=4, temperature=0
    )
    assert plain.usage.prompt_tokens == len(hf_ids(ckpt, HISTORY[:2], None))


def test_logprobs_with_tools_are_the_contents_tokens_of_the_plain_path(qwen: Stack) -> None:
    """With tools read for calls, `logprobs.content` lists the tokens of the answer's content:
    all of them when no call is made, each entry the one the same tokens get through the plain
    path (tool_choice none); none when the answer is only calls; whole and streamed alike.
    Text then a call: test_tools_mistral.py."""
    api = qwen.api.sync_client()
    kw = dict(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=12, temperature=0)
    kw.update(logprobs=True, top_logprobs=2)
    plain = api.chat.completions.create(**kw, tool_choice="none")
    auto = api.chat.completions.create(**kw)
    assert auto.choices[0].message.tool_calls is None  # the random model calls nothing here
    assert auto.choices[0].message.content == plain.choices[0].message.content
    want = logprob_entries(plain.choices[0].logprobs)
    assert len(want) == plain.usage.completion_tokens
    assert logprob_entries(auto.choices[0].logprobs) == want
    assert streamed_entries(api, kw)[:2] == (want, plain.choices[0].message.content)

    required = {**kw, "max_tokens": 80, "tool_choice": "required"}
    only_calls = api.chat.completions.create(**required)
    assert only_calls.choices[0].message.tool_calls
    assert only_calls.choices[0].logprobs.content == []
    assert streamed_entries(api, required)[0] == []


BAD = [
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ]
        },
        "tools[0].function.parameters",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": ["x"]}}]},
        "tools[0].function.parameters",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        },
        "tools[0].function.parameters",
    ),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "call_9", "content": "x"},
            ]
        },
        "messages[1].tool_call_id",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "[1"},
                        }
                    ],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
    ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages[0].role"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_tool_requests_are_400_naming_the_field(qwen: Stack, fields: dict, param: str) -> None:
    body = {"model": MODEL, "messages": HISTORY[1:2], "max_tokens": 4, **fields}
    r = httpx.post(qwen.api.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["code"] in ("invalid_value", "unsupported_parameter")


def test_nothing_is_held_after_refusals_and_tool_requests_are_counted(qwen: Stack) -> None:
    before = metrics(qwen).get("pdkv_api_tool_requests_total{tool_choice=auto}", 0)
    api = qwen.api.sync_client()
    api.chat.completions.create(model=MODEL, messages=HISTORY[1:2], tools=TOOLS, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(
            model=MODEL,
            messages=HISTORY[1:2],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "x"}},
        )
    assert metrics(qwen)["pdkv_api_tool_requests_total{tool_choice=auto}"] == before + 1
    st = qwen.wait_idle()
    assert all(s.inflight == 0 and s.pool["free"] == s.pool["total"] for s in st.values())


def test_a_template_that_cannot_render_tools_is_refused(stack: Stack) -> None:
    """The built-in tiny model's template never uses `tools` nor `tool_calls`."""
    api = stack.api.sync_client()
    model = api.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=model, messages=HISTORY[1:2], tools=TOOLS)
    assert (
        info.value.body["param"] == "tools"
        and "does not render tools" in info.value.body["message"]
    )
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=model, messages=HISTORY)
    assert info.value.body["param"] == "messages" and "tool calls" in info.value.body["message"]
    r = api.chat.completions.create(model=model, messages=HISTORY[1:2], max_tokens=2)
    assert r.choices[0].message.tool_calls is None  # a request without tools is as before
