"""A grammar whose text contains added tokens that are not special, through real daemons and
the API (issue 42): on the Qwen-like tool checkpoint (tests/support/tool_checkpoint.py:
`<tool_call>` and `</tool_call>` added tokens the decoder keeps in the text), a regex that forces
the hermes call format is answered whole, both markers drawn as their tokens, finish "stop",
token for token the single-process reference under the same grammar; through the API the same
regex on a chat with tools gives the call, finish_reason "tool_calls". A special token's name in
a regex is its characters: answered whole, the special token never drawn."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from common import client
from common.model.loader import load_model
from common.sampling_params import SamplingParams, StructuredOutput
from tests.support.api import Stack
from tests.support.daemons import BLOCK
from tests.support.structured import constrained_generate, describe, first_difference
from tests.support.tool_checkpoint import MODEL, TOOLS, hf_ids

CALL, END_CALL, IM_END = 259, 260, 2
HERMES = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome)", "unit": "(C|F)"\}\}\n</tool_call>'
)
MESSAGES = [{"role": "user", "content": "Weather in Rome?"}]


def answer_as_the_reference(
    qwen: Stack, ckpt: Path, regex: str, temperature: float
) -> client.Result:
    """The daemons' answer of the tools chat under `regex`: whole (finish "stop"), matching it,
    token for token the single-process reference's."""
    ids = hf_ids(ckpt, MESSAGES, TOOLS)
    params = SamplingParams(
        max_tokens=120,
        temperature=temperature,
        seed=7,
        structured=StructuredOutput("regex", regex),
    )
    res = asyncio.run(client.generate(qwen.pair.client_socket, sampling=params, prompt_tokens=ids))
    assert res.finish is not None and res.finish.reason == "stop", describe(res)
    assert re.fullmatch(regex, res.text), describe(res)
    model, tokenizer = load_model(ckpt)
    want = constrained_generate(model, tokenizer, ids, params, block_size=BLOCK)
    assert res.tokens == want, first_difference(res.tokens, want)
    assert qwen.wait_idle()["prefill"].inflight == 0
    return res


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_with_added_tokens_answered_whole_as_the_reference(
    qwen: Stack, ckpt: Path, temperature: float
) -> None:
    res = answer_as_the_reference(qwen, ckpt, HERMES, temperature)
    assert res.tokens.count(CALL) == 1 and res.tokens.count(END_CALL) == 1, res.tokens


def test_a_special_tokens_name_in_a_regex_is_its_characters(qwen: Stack, ckpt: Path) -> None:
    res = answer_as_the_reference(qwen, ckpt, r"(ok|no) <\|im_end\|> [a-z]{2}", 0.0)
    assert "<|im_end|>" in res.text and IM_END not in res.tokens, res.tokens


def test_api_regex_forcing_the_hermes_call_gives_the_call(qwen: Stack) -> None:
    api = qwen.api.sync_client()
    r = api.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=120,
        temperature=0,
        extra_body={"guided_regex": HERMES},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Rome") and args["unit"] in ("C", "F"), args
    assert not choice.message.content
    assert qwen.wait_idle()["prefill"].inflight == 0
