"""`--num-blocks auto` on CUDA (gpu marker): a pair of the tiny model sizes its pools from the
GPU's memory as docs/operations.md's "Sizing the KV pools" says, its warm-up stays within the
reserve, and it serves as the single-process reference does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from common import client
from common.cuda import cuda_available
from common.daemon.pool_size import CUDA_WORKSPACES, reserve_bytes
from common.model import reference
from common.model.arena import WeightsLayout
from common.model.config import LlamaConfig
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from decode_server.config import DecodeConfig
from prefill_server.config import PrefillConfig
from tests.support.daemons import Pair, status

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)"),
]

FRACTION = 0.01  # ~0.8 GiB of an H100: ~10^5 of the tiny model's 8 KiB fp32 blocks
MIB = 2**20


def _line(log: Path, event: str) -> dict:
    (line,) = [json.loads(x) for x in log.read_text().splitlines() if f'"{event}"' in x]
    return line


def test_gpu_auto_pools_fit_the_formula_and_serve_as_the_reference(pair_factory: Pair) -> None:
    args = ("--device", "cuda:0", "--dtype", "float32", "--num-blocks", "auto")
    args += ("--memory-fraction", str(FRACTION))
    dec = pair_factory.start("decode", *args)
    pre = pair_factory.start("prefill", *args)
    model, _ = load_model(None, device="cuda:0", dtype=torch.float32)
    tiny = LlamaConfig.tiny()
    total = torch.cuda.mem_get_info(0)[1]
    weights = WeightsLayout.of(tiny, torch.float32, separate_head=True).nbytes
    block = 2 * tiny.num_layers * 16 * tiny.num_kv_heads * tiny.head_dim * 4
    configs = {"decode": DecodeConfig(), "prefill": PrefillConfig()}
    for d in (dec, pre):
        sized = _line(d.log, "pool_sized")
        forward = configs[d.role].largest_forward("cuda", 8192, model.use_kernels)
        reserve = reserve_bytes(tiny, 4, forward) + CUDA_WORKSPACES
        assert sized["total_mib"] == round(total / MIB, 1), sized
        assert sized["budget_mib"] == round(int(FRACTION * total) / MIB, 1), sized
        assert sized["reserve_mib"] == round(reserve / MIB, 1), sized
        assert sized["block_bytes"] == block and sized["limited_by"] == "budget", sized
        # --no-share-weights is CUDA's default: each daemon pays for its own weights, and holds
        # at least them (torch's allocator may hold a little more)
        held = sized["held_mib"] * MIB
        assert held >= weights - 0.05 * MIB, sized
        want = (int(FRACTION * total) - held - reserve) / block
        assert abs(sized["blocks"] - want) <= 0.2 * MIB / block, (sized, want)
        assert status(str(d.socket)).pool["total"] == sized["blocks"]
        if model.use_kernels:  # the warm-up ran every forward shape and captured the graphs
            checked = _line(d.log, "pool_reserve_checked")
            assert checked["warm_peak_mib"] <= checked["reserve_mib"], checked

    prompts = [[7, 8, 9], list(range(40)), [200] * 100, list(range(255, 0, -1))]
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    async def run() -> list:
        return await asyncio.gather(
            *(
                client.generate(pair_factory.client_socket, prompt_tokens=p, sampling=params)
                for p in prompts
            )
        )

    for got, prompt in zip(asyncio.run(run()), prompts, strict=True):
        assert got.tokens == reference.generate(model, prompt, params)
