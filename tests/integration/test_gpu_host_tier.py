"""The host KV tier through the daemons on CUDA (gpu marker), fp32: four 6-turn conversations at
once, each turn re-sending the conversation with the daemons' own answers, equal the reference
token for token, and each later turn's prompt finds its history (answers included) in the pinned
tier: the prefill computes about the new message only."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest
import torch

from common import client
from common.cuda import cuda_available
from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)"),
]
BLOCK = 16
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


async def _conversation(sock: str, seed: int) -> list[tuple[list[int], list[int], int]]:
    rng = random.Random(seed)
    history: list[int] = []
    turns = []
    for turn in range(6):
        prompt = history + [rng.randrange(256) for _ in range(40 if turn == 0 else 12)]
        res = await client.generate(sock, prompt_tokens=prompt, sampling=PARAMS)
        assert res.finish is not None
        turns.append((prompt, res.tokens, res.finish.usage.cached_tokens))
        history = prompt + res.tokens
    return turns


def test_gpu_conversations_find_their_answers_in_the_tier(pair_factory) -> None:  # type: ignore[no-untyped-def]
    path = Path(f"/dev/shm/pdkv-test-gpu-daemons-{os.getpid()}")
    tier = ["--host-cache-gb", "0.05", "--host-cache-path", str(path)]
    args = ("--device", "cuda:0", "--dtype", "float32")
    try:
        pair_factory.start("decode", *args, *tier)
        pair_factory.start("prefill", *args, "--num-blocks", "48", *tier)

        async def all_of_them():  # type: ignore[no-untyped-def]
            sock = pair_factory.client_socket
            return await asyncio.gather(*(_conversation(sock, s) for s in range(4)))

        convs = asyncio.run(all_of_them())
        model, _ = load_model(None, device="cuda:0", dtype=torch.float32)
        for conv in convs:
            written = 0
            for turn, (prompt, tokens, cached) in enumerate(conv):
                assert tokens == reference.generate(model, prompt, PARAMS), f"turn {turn}"
                whole = min(written // BLOCK, (len(prompt) - 1) // BLOCK) * BLOCK
                # the answer's last block is committed on the tier's thread after its copy:
                # one block may still be on its way when the next turn looks
                assert whole - BLOCK <= cached <= whole, (turn, cached, whole)
                written = len(prompt) + len(tokens) - 1
        st = asyncio.run(client.status(pair_factory.client_socket))
        assert st.prefix_cache["host_tier_hits"] > 0
        assert st.prefix_cache["host_tier_checksum_failures"] == 0
    finally:
        pair_factory.kill_all()
        path.unlink(missing_ok=True)
