"""Qwen2, Qwen3 and Mistral checkpoints served by the real daemons: greedy tokens equal transformers'.

Each family's random checkpoint (saved by transformers, tests/support/checkpoints.py) is served by
a prefill and a decode daemon on the CPU; two concurrent requests (a batch at the decode, prompts
and outputs crossing KV block boundaries) must produce transformers' own greedy tokens.
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
