"""Mistral's v11 tool-call form through the real stack: a random Mistral checkpoint whose
tokenizer holds `[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]` as special tokens (as Mistral's do) and
whose template writes `[TOOL_CALLS]name[ARGS]{...}`. A grammar (structured_outputs with the
tokens by id) makes the model write text and then calls, as a trained model would; the API puts
the markers the daemons drop back into the text, the v11 parser reads them, whole and streamed,
and logprobs list the text's tokens only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.api import Stack
from tests.support.tool_checkpoint import (
    MISTRAL_SPECIALS,
    MISTRAL_V11,
    MISTRAL_V11_TEMPLATE,
    TOOLS,
    hf_ids,
    logprob_entries,
    streamed_entries,
    tool_stack,
)

pytest.importorskip("transformers")

MODEL = "mistral-v11-tools"
CALLS_ID, ARGS_ID = MISTRAL_SPECIALS.index("[TOOL_CALLS]"), MISTRAL_SPECIALS.index("[ARGS]")
#: text, then two calls, as Mistral's v11 models write them (the markers are tokens)
GRAMMAR = (
    f'start: "Sure. " <[{CALLS_ID}]> "get_weather" <[{ARGS_ID}]> '
    f'"{{\\"city\\": \\"Rome\\", \\"unit\\": \\"C\\"}}" <[{CALLS_ID}]> "get_time" <[{ARGS_ID}]> "{{}}"'
)
USER = [{"role": "user", "content": "Weather in Rome, and the time?"}]
WANT_CALLS = [("get_weather", '{"city": "Rome", "unit": "C"}'), ("get_time", "{}")]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with tool_stack(
        tmp_path_factory,
        MODEL,
        template=MISTRAL_V11_TEMPLATE,
        family="mistral",
        vocab=MISTRAL_V11,
    ) as s:
        yield s


def ask(**extra: object) -> dict:
    return dict(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        max_tokens=120,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": GRAMMAR}},
        **extra,
    )


def test_v11_calls_after_text_whole_and_streamed(mistral: Stack) -> None:
    api = mistral.api.sync_client()
    ckpt = Path(mistral.statuses()["prefill"].model_card.path)
    plain = api.chat.completions.create(**ask(tool_choice="none"))
    # the daemons' text drops the special tokens: no parser could split this
    assert (
        plain.choices[0].message.content
        == 'Sure. get_weather{"city": "Rome", "unit": "C"}get_time{}'
    )
    assert plain.usage.prompt_tokens == len(hf_ids(ckpt, USER, TOOLS))
    whole = api.chat.completions.create(**ask())
    message = whole.choices[0].message
    assert message.content == "Sure. "
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == WANT_CALLS
    assert all(len(c.id) == 9 and c.id.isalnum() for c in message.tool_calls)
    assert whole.choices[0].finish_reason == "tool_calls"
    content, calls, reasons = "", {}, []
    for chunk in api.chat.completions.create(**ask(), stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                if part.id is not None:
                    calls[part.index] = [part.function.name, ""]
                calls[part.index][1] += part.function.arguments or ""
            reasons += [choice.finish_reason] if choice.finish_reason else []
    assert content == "Sure. " and [tuple(c) for c in calls.values()] == WANT_CALLS
    assert reasons == ["tool_calls"]


def test_a_v11_call_in_the_history_renders_as_transformers(mistral: Stack) -> None:
    api = mistral.api.sync_client()
    ckpt = Path(mistral.statuses()["prefill"].model_card.path)
    call = {
        "id": "a1B2c3D4e",
        "type": "function",
        "function": {"name": "get_time", "arguments": json.dumps({})},
    }
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "12:00"},
    ]
    r = api.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert r.usage.prompt_tokens == len(hf_ids(ckpt, history, TOOLS))


def test_logprobs_list_the_text_before_the_calls(mistral: Stack) -> None:
    """The content's tokens, each with the entry the plain path (tool_choice none) gives it;
    not the markers' or the calls' tokens; whole and streamed alike."""
    api = mistral.api.sync_client()
    lp = dict(logprobs=True, top_logprobs=3)
    everything = logprob_entries(
        api.chat.completions.create(**ask(tool_choice="none", **lp)).choices[0].logprobs
    )
    got = logprob_entries(api.chat.completions.create(**ask(**lp)).choices[0].logprobs)
    assert "".join(t for t, _, _ in got) == "Sure. "  # a byte a token
    assert got == everything[: len(got)] and len(got) < len(everything)
    kw = ask(**lp)
    assert streamed_entries(api, kw) == (got, "Sure. ", ["get_weather", "get_time"])
