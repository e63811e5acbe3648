"""A real model calls a tool by itself (`tool_choice` auto, no grammar): SmolLM2-135M-Instruct's
weights and tokenizer under Qwen2.5's tools template (both are ChatML), shown one earlier call,
answers "Weather in Rome?" with `<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}
</tool_call>` (transformers' greedy answer too, 2026-12-05). Through the daemons and the API with
the openai client, the call, the tool's result and the model's answer are the daemons' greedy
text for transformers' prompt ids read by the hermes parser, whole and streamed (that the daemons'
greedy tokens are transformers' is tests/model/test_real_checkpoint.py's).

SmolLM2's own template never uses `tools`: served as it is, tools are refused (test_tools_spec).
Skips where SmolLM2 is not installed (tests.support.smollm2)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_server.chat import ChatTemplate
from api_server.errors import ApiError
from api_server.tools.assembler import ToolAssembler, fold
from api_server.tools.parsers import Hermes
from api_server.tools.plan import plan
from api_server.tools.spec import tool_request
from common import client
from common.sampling_params import SamplingParams
from tests.support.api import Stack, short_runtime, start_api
from tests.support.daemons import Pair
from tests.support.smollm2 import smollm2_dir
from tests.support.tool_checkpoint import TEMPLATE

transformers = pytest.importorskip("transformers")

MODEL = "smol-tools"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SHOWN = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "user", "content": "Weather in Rome?"},
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's files (linked) with Qwen2.5's tools template as its chat_template.jinja."""
    src = smollm2_dir()
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    path.mkdir()
    for f in src.iterdir():
        if f.name != "chat_template.jinja":
            (path / f.name).symlink_to(f)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory, ckpt: Path) -> Iterator[Stack]:
    pair = Pair(short_runtime(tmp_path_factory))
    pair.extra = {role: ["--model", str(ckpt)] for role in ("decode", "prefill")}
    try:
        pair.start("decode")
        pair.start("prefill")
        api = start_api(pair.runtime)
        yield Stack(pair, api)
        assert api.stop() == 0
    finally:
        pair.kill_all()


@pytest.fixture(scope="module")
def hf(ckpt: Path):
    return transformers.AutoTokenizer.from_pretrained(ckpt)


def for_hf(messages: list[dict]) -> list[dict]:
    """The chat as transformers' templates take it: arguments as objects, tool results named."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        if m["role"] == "tool":
            m["name"] = "get_weather"
        out.append(m)
    return out


def expected(stack: Stack, hf, messages: list[dict], max_tokens: int) -> tuple[int, dict, str]:
    """(prompt tokens, the message, finish reason) of the daemons' greedy answer to
    transformers' prompt ids, read by the hermes parser."""
    ids = hf.apply_chat_template(
        for_hf(messages), tools=TOOLS, add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    params = SamplingParams(max_tokens=max_tokens)
    res = asyncio.run(client.generate(stack.pair.client_socket, sampling=params, prompt_tokens=ids))
    assert res.finish is not None
    asm = ToolAssembler(Hermes())
    deltas = asm.feed(res.text)
    last, finish = asm.finish("length" if res.finish.reason == "length" else "stop")
    return len(ids), fold(deltas + last), finish


def shape(message: dict) -> dict:
    """The message without the calls' random ids."""
    calls = [{**c, "id": "-"} for c in message.get("tool_calls") or []]
    return {"content": message.get("content"), "tool_calls": calls}


def test_smollm2_calls_the_tool_by_itself(smol: Stack, hf) -> None:
    api = smol.api.sync_client()
    prompt, message, finish = expected(smol, hf, SHOWN, 40)
    assert finish == "tool_calls"
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    ]
    r = api.chat.completions.create(
        model=MODEL, messages=SHOWN, tools=TOOLS, max_tokens=40, temperature=0
    )
    assert r.usage.prompt_tokens == prompt
    assert shape(r.choices[0].message.model_dump()) == shape(message)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None

    calls: dict[int, dict] = {}
    order = []
    for chunk in api.chat.completions.create(
        model=MODEL, messages=SHOWN, tools=TOOLS, max_tokens=40, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            assert not choice.delta.content  # all of it is the call
            for part in choice.delta.tool_calls or []:
                order.append("header" if part.id else "arguments")
                if part.id:
                    calls[part.index] = {"name": part.function.name, "arguments": ""}
                calls[part.index]["arguments"] += part.function.arguments or ""
            if choice.finish_reason:
                order.append(choice.finish_reason)
    assert list(calls.values()) == [c["function"] for c in message["tool_calls"]]
    assert order[0] == "header" and order[-1] == "tool_calls" and "arguments" in order

    two = api.chat.completions.create(
        model=MODEL, messages=SHOWN, tools=TOOLS, max_tokens=40, temperature=0, n=2
    )
    assert [shape(c.message.model_dump()) for c in two.choices] == [shape(message)] * 2
    ids = [c.message.tool_calls[0].id for c in two.choices]
    assert ids[0] != ids[1]  # each choice's calls have their own ids


def test_the_loop_a_call_its_result_and_the_answer(smol: Stack, hf) -> None:
    api = smol.api.sync_client()
    messages = list(SHOWN)
    first = api.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0
    )
    (call,) = first.choices[0].message.tool_calls
    city = json.loads(call.function.arguments)["city"]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append(
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"city": city, "sky": "sunny"}),
        }
    )
    prompt, message, finish = expected(smol, hf, messages, 16)
    answer = api.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=16, temperature=0
    )
    assert answer.usage.prompt_tokens == prompt
    assert shape(answer.choices[0].message.model_dump()) == shape(message)
    assert answer.choices[0].finish_reason == finish
    st = smol.wait_idle()
    assert all(s.inflight == 0 and s.pool["free"] == s.pool["total"] for s in st.values())


def test_smollm2s_own_template_cannot_show_tools() -> None:
    source = ChatTemplate.for_model(smollm2_dir()).source
    with pytest.raises(ApiError) as info:
        plan(tool_request(TOOLS, None, None), SHOWN[:1], source, None)
    assert info.value.param == "tools" and info.value.code == "unsupported_parameter"


def test_tool_parser_flag_overrides_the_template(smol: Stack) -> None:
    """A second API on the same daemons with --tool-parser llama3_json: the hermes call is not
    a llama3 call, so it stays text."""
    other = start_api(smol.pair.runtime, "--tool-parser", "llama3_json")
    try:
        r = other.sync_client().chat.completions.create(
            model=MODEL, messages=SHOWN, tools=TOOLS, max_tokens=40, temperature=0
        )
    finally:
        assert other.stop() == 0
    message = r.choices[0].message
    assert message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert message.content.startswith("<tool_call>") and '"city": "Rome"' in message.content
