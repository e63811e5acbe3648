"""The prefix cache as API users see it: OpenAI's usage.prompt_tokens_details.cached_tokens, and
the daemons' prefix-cache counters on /metrics."""

from __future__ import annotations

from tests.support.api import MODEL, Stack, metrics

PROMPT = "A system prompt every request of this service starts with, then a question."  # 75 bytes


def _complete(stack: Stack, prompt: str):  # type: ignore[no-untyped-def]
    return stack.api.sync_client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )


def test_a_repeated_prompt_reports_its_cached_tokens(stack: Stack) -> None:
    before = metrics(stack)
    first = _complete(stack, PROMPT)
    again = _complete(stack, PROMPT)
    n = first.usage.prompt_tokens  # BOS + the bytes
    assert n == again.usage.prompt_tokens == 1 + len(PROMPT.encode())
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    block = 16  # the daemons' default --block-size
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // block * block
    assert again.choices[0].text == first.choices[0].text
    after = metrics(stack)
    key = "pdkv_prefix_cache_{}_total{{role=prefill}}"
    hit = after[key.format("hit_tokens")] - before.get(key.format("hit_tokens"), 0)
    queried = after[key.format("queried_tokens")] - before.get(key.format("queried_tokens"), 0)
    assert hit == again.usage.prompt_tokens_details.cached_tokens
    assert queried == 2 * n
    assert after["pdkv_prefix_cache_blocks{role=prefill}"] >= (n - 1) // block
    assert after["pdkv_pool_blocks{role=prefill,state=cached}"] >= (n - 1) // block
