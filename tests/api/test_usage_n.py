"""`usage` with `n` > 1, through the real API and daemons: each prompt is counted once in
`prompt_tokens` (as OpenAI counts it), whatever the number of choices; completion tokens are
every choice's. Completions and chat, whole and streamed (`stream_options.include_usage`)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.api import MODEL, Stack

MAX_TOKENS = 3
FIXED = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}


def _usage(stack: Stack, *, chat: bool, stream: bool, n: int, prompt: Any) -> Any:
    api = stack.api.sync_client()
    kw: dict[str, Any] = {"model": MODEL, "n": n, **FIXED}
    if stream:
        kw |= {"stream": True, "stream_options": {"include_usage": True}}
    if chat:
        reply = api.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        reply = api.completions.create(prompt=prompt, **kw)
    if not stream:
        return reply.usage
    chunks = list(reply)
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) == 1 and not chunks[-1].choices, chunks[-1]
    return usages[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_prompt_tokens_count_the_prompt_once_with_n(stack: Stack, chat: bool, stream: bool) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    one = _usage(stack, chat=chat, stream=stream, n=1, prompt=prompt)
    two = _usage(stack, chat=chat, stream=stream, n=2, prompt=prompt)
    assert one.prompt_tokens > 0 and one.completion_tokens == MAX_TOKENS
    assert two.prompt_tokens == one.prompt_tokens, (one, two)
    assert two.completion_tokens == 2 * MAX_TOKENS
    assert two.total_tokens == two.prompt_tokens + two.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_several_prompts_with_n_count_each_prompt_once(stack: Stack, stream: bool) -> None:
    prompts = ["Once upon a time", "A much longer prompt than the first one, by far"]
    each = [_usage(stack, chat=False, stream=stream, n=1, prompt=p).prompt_tokens for p in prompts]
    assert each[0] != each[1]
    three = _usage(stack, chat=False, stream=stream, n=3, prompt=prompts)
    assert three.prompt_tokens == sum(each)
    assert three.completion_tokens == len(prompts) * 3 * MAX_TOKENS
