"""Cold start on CUDA (gpu marker; issue 24, item 4): every kernel the serving path meets is
compiled while the daemons start, so serving compiles nothing. Measured where Triton says it:
its cache directory (a fresh `--kernel-cache-dir`) gains no kernel during a burst of mixed
requests (prompts from 1 token to thousands, alone and batched, greedy and sampled, decode
batches of every size up to --max-batch)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from common import client
from common.cuda import cuda_available
from common.model.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)"),
]


def _kernels(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir() if p.is_dir()}


async def _burst(sock: str, rng: random.Random, n: int, longest: int) -> list[client.Result]:
    def params(i: int) -> SamplingParams:
        if i % 3:
            return SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True)
        return SamplingParams(
            max_tokens=rng.randrange(2, 40), temperature=0.8, top_k=20, top_p=0.9, seed=i
        )

    lengths = [rng.choice([1, 2, 15, 16, 17, 100, 511, 512, 1000, longest]) for _ in range(n)]
    return await asyncio.gather(
        *(
            client.generate(
                sock,
                prompt_tokens=[rng.randrange(256) for _ in range(m)],
                sampling=params(i),
                request_id=f"c{i}",
            )
            for i, m in enumerate(lengths)
        )
    )


def test_serving_compiles_no_kernel_after_the_start(pair_factory, tmp_path: Path) -> None:
    cache = tmp_path / "kernels"
    args = ("--device", "cuda:0", "--kernel-cache-dir", str(cache), "--max-batch", "24")
    args += ("--num-blocks", "8192")  # 40 prompts of up to 3,000 tokens at once: no waiting
    pair_factory.start("decode", *args)
    prefill = pair_factory.start("prefill", *args, "--max-prompt-tokens", "3000")
    compiled = _kernels(cache)
    assert compiled, "the start compiled the kernels into --kernel-cache-dir"
    rng = random.Random(24)
    sock = pair_factory.client_socket
    for n in (1, 7, 24, 40):  # one alone, a few, a full decode batch, more than one batch
        results = asyncio.run(_burst(sock, rng, n, 3000))
        assert all(r.tokens for r in results)
    new = _kernels(cache) - compiled
    assert not new, f"{len(new)} kernel(s) compiled while serving: {sorted(new)}"
    for daemon in (pair_factory.daemons["decode"], prefill):
        warmed = [json.loads(x) for x in daemon.log_text().splitlines() if '"kernels_warmed"' in x]
        assert len(warmed) == 1 and warmed[0]["shapes"] > 1, daemon.role
    assert pair_factory.stop_all() == {"prefill": 0, "decode": 0}
