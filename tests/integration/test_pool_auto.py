"""`--num-blocks auto` on the CPU: real daemons size their pools from the host's memory as the
formula says (docs/operations.md, "Sizing the KV pools"), serve as the reference does, and a
share too small for one sequence is refused at start."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from common import client
from common.daemon.memory import cgroup_memory
from common.daemon.pool_size import reserve_bytes
from common.model import reference
from common.model.arena import WeightsLayout
from common.model.config import LlamaConfig
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from decode_server.config import DecodeConfig
from prefill_server.config import PrefillConfig
from tests.support.daemons import Pair, status

FRACTION = 0.002  # ~48 MiB of a 24 GiB host: a few thousand of the tiny model's 8 KiB blocks
DECODE = ("--num-blocks", "auto", "--memory-fraction", str(FRACTION), "--max-batch", "4")
PREFILL = ("--num-blocks", "auto", "--memory-fraction", str(FRACTION), "--max-prompt-tokens", "512")


def _expected_blocks(cfg: DecodeConfig | PrefillConfig, held: int) -> int:
    """The formula, from the host's size, the tiny model's shapes and what the daemon holds."""
    tiny = LlamaConfig.tiny()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit, _ = cgroup_memory()  # a container's limit, where there is one
    total = min(total, limit) if limit else total
    forward = cfg.largest_forward("cpu", tiny.max_position_embeddings, kernels=False)
    reserve = reserve_bytes(tiny, 4, forward)
    block = 2 * tiny.num_layers * 16 * tiny.num_kv_heads * tiny.head_dim * 4  # K+V, fp32
    return (int(FRACTION * total) - held - reserve) // block


def _pool_sized(log: Path) -> dict:
    (line,) = [json.loads(x) for x in log.read_text().splitlines() if '"pool_sized"' in x]
    return line


def test_auto_pools_follow_the_formula_and_serve_as_the_reference(pair_factory: Pair) -> None:
    dec = pair_factory.start("decode", *DECODE)
    pre = pair_factory.start("prefill", *PREFILL)
    weights = WeightsLayout.of(LlamaConfig.tiny(), torch.float32, separate_head=True).nbytes
    # the decode started first: it loaded the host's one copy of the weights, the prefill maps it
    want = {
        "decode": _expected_blocks(DecodeConfig(max_batch=4), held=weights),
        "prefill": _expected_blocks(PrefillConfig(max_prompt_tokens=512), held=0),
    }
    for d in (dec, pre):
        logged = _pool_sized(d.log)
        assert logged["limited_by"] == "budget", logged  # the host has far more free than 48 MiB
        assert logged["blocks"] == want[d.role] > 512, (d.role, logged, want)
        assert status(str(d.socket)).pool["total"] == want[d.role]

    prompts = [[7, 8, 9], list(range(40)), [200] * 100]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def run() -> list:
        return await asyncio.gather(
            *(
                client.generate(pair_factory.client_socket, prompt_tokens=p, sampling=params)
                for p in prompts
            )
        )

    model, _ = load_model(None, device="cpu", dtype=torch.float32)
    for got, prompt in zip(asyncio.run(run()), prompts, strict=True):
        assert got.tokens == reference.generate(model, prompt, params)


def test_a_share_too_small_for_one_sequence_exits_3(runtime_dir: Path) -> None:
    """The decode's default batch of 64 at 8,192 positions needs ~400 MiB for the torch
    attention alone: 0.002 of the host leaves it no block."""
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(runtime_dir), "decode", "start"]
    proc = subprocess.run(
        [*argv, "--device", "cpu", "--num-blocks", "auto", "--memory-fraction", str(FRACTION)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "--num-blocks auto: 0.002 of" in line and "needs 512" in line, line
    assert "raise --memory-fraction" in line
    assert "Traceback" not in proc.stderr + proc.stdout
