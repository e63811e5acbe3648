"""Sampling features through the official `openai` client against real daemons (issue 25):
logprobs (completions and chat), echo with prompt logprobs and max_tokens 0 (what
lm-evaluation-harness sends), the penalties, n, min_tokens and stop_token_ids.

Expected values come from the tiny model itself: its dense forward (`forward_dense`, the test
oracle) for logprobs, and the single-process reference for tokens.
"""

from __future__ import annotations

import pytest
import torch

from api_server.chat import ChatTemplate
from common.model import reference
from common.model.loader import load_model
from common.model.tokenizer import ByteTokenizer
from common.sampling_params import SamplingParams
from tests.support.api import MODEL, Stack, openai

TOL = 1e-4
PROMPTS = [[256, *b"The quick brown fox"], [256, *b"Paged attention"]]


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    model, _ = load_model(None)
    return model


def log_softmax_of(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[len(ids), vocab]: row t is the distribution of token t + 1."""
    return torch.log_softmax(model.forward_dense(torch.tensor(ids)), dim=-1)


def ids_of(tokens: list[str]) -> list[int]:
    """The byte tokenizer's ids of ASCII token strings (one byte each)."""
    return [ord(t) for t in tokens]


def test_completion_logprobs_equal_log_softmax_of_the_logits(stack: Stack, tiny) -> None:  # type: ignore[no-untyped-def]
    api = stack.api.sync_client()
    out = api.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    expected = reference.generate(tiny, PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True))
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == choice.text == ByteTokenizer().decode(expected)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    ref = log_softmax_of(tiny, PROMPTS[0] + expected)
    for i, tok in enumerate(expected):
        row = ref[len(PROMPTS[0]) - 1 + i]
        assert lp.token_logprobs[i] == pytest.approx(float(row[tok]), abs=TOL)
        # greedy: the token is the likeliest, so its logprob is the top one
        assert max(lp.top_logprobs[i].values()) == pytest.approx(float(row.max()), abs=TOL)
        assert len(lp.top_logprobs[i]) <= 3


def test_chat_logprobs_and_top_logprobs_equal_log_softmax(stack: Stack, tiny) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Say hi"}]
    text, ids = ChatTemplate.for_model(None).prompt(messages)
    prompt = ids if ids is not None else ByteTokenizer().encode(text)
    out = stack.api.sync_client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    generated = [c.bytes[0] for c in content]
    assert all(len(c.bytes) == 1 for c in content)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    assert generated == reference.generate(tiny, prompt, params)
    ref = log_softmax_of(tiny, prompt + generated)
    for i, c in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        assert c.logprob == pytest.approx(float(row[generated[i]]), abs=TOL)
        top_lp, top_ids = torch.topk(row, 4)
        shown = [t.bytes[0] if len(t.bytes) == 1 else None for t in c.top_logprobs]
        assert shown == [t if t < 256 else None for t in top_ids.tolist()]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(top_lp.tolist(), abs=TOL)
        assert len(c.top_logprobs) == 4
    streamed = []
    for chunk in stack.api.sync_client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs else []
    assert [(c.bytes, c.logprob) for c in streamed] == [(c.bytes, c.logprob) for c in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs must be") as info:
        stack.api.sync_client().chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, logprobs=True, top_logprobs=21
        )
    assert info.value.body["param"] == "top_logprobs"


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_prompt_logprobs_as_lm_eval_asks(stack: Stack, tiny, max_tokens: int) -> None:  # type: ignore[no-untyped-def]
    """lm-evaluation-harness's log-likelihood request: a batch of token-id prompts, echo,
    logprobs 1, max_tokens 0 or 1, temperature 0."""
    out = stack.api.sync_client().completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=max_tokens, temperature=0, logprobs=1, echo=True
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == sum(len(p) for p in PROMPTS)
    assert out.usage.completion_tokens == max_tokens * len(PROMPTS)
    for prompt, choice in zip(PROMPTS, out.choices, strict=True):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # as OpenAI
        ref = log_softmax_of(tiny, prompt)
        want = [float(ref[t - 1, prompt[t]]) for t in range(1, len(prompt))]
        assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(want, abs=TOL)
        for t in range(1, len(prompt)):
            assert max(lp.top_logprobs[t].values()) == pytest.approx(
                float(ref[t - 1].max()), abs=TOL
            )
        assert ids_of(lp.tokens[1 : len(prompt)]) == prompt[1:]
        assert choice.text.startswith("The quick" if prompt is PROMPTS[0] else "Paged")
        assert choice.finish_reason == "length"
        assert lp.text_offset[1] == len(lp.tokens[0])


def test_echo_without_logprobs_prepends_the_prompt(stack: Stack) -> None:
    api = stack.api.sync_client()
    plain = api.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    echoed = api.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "Hello" + plain.choices[0].text
    assert echoed.choices[0].logprobs is None


def test_streamed_logprobs_and_echo_equal_the_whole_answer(stack: Stack) -> None:
    api = stack.api.sync_client()
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=2, echo=True)
    whole = api.completions.create(**kw).choices[0]
    text, tokens, token_lps = "", [], []
    for chunk in api.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                token_lps += c.logprobs.token_logprobs
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    assert token_lps == whole.logprobs.token_logprobs


def test_penalties_equal_the_reference(stack: Stack, tiny) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(
        max_tokens=24,
        ignore_eos=True,
        presence_penalty=0.8,
        frequency_penalty=0.6,
        repetition_penalty=1.4,
    )
    out = stack.api.sync_client().completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=24,
        temperature=0,
        presence_penalty=0.8,
        frequency_penalty=0.6,
        extra_body={"repetition_penalty": 1.4, "ignore_eos": True},
    )
    expected = reference.generate(tiny, PROMPTS[0], params)
    assert out.choices[0].text == ByteTokenizer().decode(expected)
    plain = reference.generate(tiny, PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True))
    assert expected != plain  # the penalties change the answer


def test_n_choices_with_seeds_and_summed_usage(stack: Stack) -> None:
    api = stack.api.sync_client()
    kw = dict(model=MODEL, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    out = api.completions.create(prompt=["Once", "Twice"], n=3, seed=11, **kw)
    assert [c.index for c in out.choices] == list(range(6))
    assert out.usage.completion_tokens == 6 * 8
    for i, prompt in enumerate(["Once", "Twice"]):
        for j in range(3):
            alone = api.completions.create(prompt=prompt, seed=11 + j, **kw)
            assert out.choices[i * 3 + j].text == alone.choices[0].text, (i, j)
    assert len({c.text for c in out.choices[:3]}) > 1  # different seeds, different answers
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3, seed=5
    )
    assert [c.index for c in chat.choices] == [0, 1]
    streamed = {0: "", 1: ""}
    for chunk in api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=3,
        seed=5,
        stream=True,
    ):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == {c.index: c.message.content for c in chat.choices}


def test_stop_token_ids_and_min_tokens(stack: Stack, tiny) -> None:  # type: ignore[no-untyped-def]
    api = stack.api.sync_client()
    greedy = reference.generate(tiny, PROMPTS[0], SamplingParams(max_tokens=10, ignore_eos=True))
    stop = greedy[3]
    out = api.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=10,
        temperature=0,
        extra_body={"stop_token_ids": [stop], "ignore_eos": True},
    )
    first = greedy.index(stop)
    assert out.choices[0].text == ByteTokenizer().decode(greedy[: first + 1])
    assert out.usage.completion_tokens == first + 1
    assert out.choices[0].finish_reason == "stop"
    # min_tokens past that point: the stop id cannot be drawn before it
    params = SamplingParams(
        max_tokens=10, ignore_eos=True, min_tokens=first + 2, stop_token_ids=(stop,)
    )
    out = api.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=10,
        temperature=0,
        extra_body={"stop_token_ids": [stop], "ignore_eos": True, "min_tokens": first + 2},
    )
    expected = reference.generate(tiny, PROMPTS[0], params)
    assert out.choices[0].text == ByteTokenizer().decode(expected)
    assert out.usage.completion_tokens == len(expected)
    assert stop not in expected[: first + 2]
