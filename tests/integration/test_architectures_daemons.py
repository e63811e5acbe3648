"""Qwen2, Qwen3 and Mistral checkpoints served by the real daemons: greedy tokens equal transformers'.

Each family's random checkpoint (saved by transformers, tests/support/checkpoints.py) is served by
a prefill and a decode daemon on the CPU; two concurrent requests (a batch at the decode, prompts
and outputs crossing KV block boundaries) must produce transformers' own greedy tokens. With a
sliding window shorter than the prompt, so must a prompt served in chunks and again from the
prefix cache.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from common import client
from common.model.sampling import SamplingParams
from tests.support.checkpoints import save_hf_model
from tests.support.daemons import Pair

pytest.importorskip("transformers")

NEW_TOKENS = 16
PROMPTS = [[1, *range(40, 60)], [1, 7, 250, 3, 99, 42]]


def _hf_greedy(hf, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """Argmax continuation by full forwards (no cache, no end-of-sequence stop)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_greedy_tokens_through_the_daemons_equal_transformers(
    pair_factory: Pair, tmp_path: Path, family: str
) -> None:
    hf = save_hf_model(tmp_path / family, family, tie=family == "qwen3")
    want = [_hf_greedy(hf, p) for p in PROMPTS]
    model = ("--model", str(tmp_path / family), "--allow-byte-tokenizer")
    pair_factory.start("decode", *model)
    pair_factory.start("prefill", *model)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    async def both() -> list[client.Result]:
        return await asyncio.gather(
            *(
                client.generate(pair_factory.client_socket, prompt_tokens=p, sampling=greedy)
                for p in PROMPTS
            )
        )

    got = asyncio.run(both())
    assert [r.tokens for r in got] == want
    assert pair_factory.stop_all() == {"prefill": 0, "decode": 0}


# A window shorter than the prompt (21 tokens, blocks of 4): Mistral's on both layers, Qwen3's
# on its second (max_window_layers 1)
WINDOWED = {
    "mistral": {"sliding_window": 8},
    "qwen3": {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
}
WINDOW_PROMPT = [1, *range(40, 60)]


@pytest.mark.parametrize("family", list(WINDOWED))
def test_sliding_window_through_the_daemons_equals_transformers(
    pair_factory: Pair, tmp_path: Path, family: str
) -> None:
    """Blocks of 4 and chunks of 12 tokens (the prompt's second chunk attends to its first
    through the pool), the prefix cache on: a prompt, then the same prompt again (its first 5
    blocks come from the cache, so its last token's attention runs over cached blocks through
    the windowed context path) beside a longer one that shares 4 of those blocks; every output
    is transformers' greedy continuation."""
    hf = save_hf_model(tmp_path / family, family, **WINDOWED[family])
    longer = [*WINDOW_PROMPT[:16], *range(200, 211)]
    want = {tuple(p): _hf_greedy(hf, p) for p in (WINDOW_PROMPT, longer)}
    model = ("--model", str(tmp_path / family), "--allow-byte-tokenizer", "--block-size", "4")
    pair_factory.start("decode", *model)
    pair_factory.start("prefill", *model, "--max-prefill-tokens", "12")
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    async def run(*prompts: list[int]) -> list[client.Result]:
        return await asyncio.gather(
            *(
                client.generate(pair_factory.client_socket, prompt_tokens=p, sampling=greedy)
                for p in prompts
            )
        )

    (first,) = asyncio.run(run(WINDOW_PROMPT))
    assert first.finish.usage.cached_tokens == 0
    assert first.tokens == want[tuple(WINDOW_PROMPT)]
    again, shared = asyncio.run(run(WINDOW_PROMPT, longer))
    assert again.finish.usage.cached_tokens == 20
    assert shared.finish.usage.cached_tokens == 16
    assert again.tokens == want[tuple(WINDOW_PROMPT)]
    assert shared.tokens == want[tuple(longer)]
    assert pair_factory.stop_all() == {"prefill": 0, "decode": 0}
