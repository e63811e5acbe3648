"""bench/soak.py --mix through real daemons on CPU (a prefill and one or two decodes): shared
prefixes, chunked long prompts, seeded sampling, aborts and closed connections under pool pressure
leave no block held on any side, and every request's tokens (those of one cut short: a prefix of
them) equal the single-process reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


@pytest.mark.parametrize("decodes", [1, 2])
def test_mixed_traffic_leaves_no_block_held_and_the_reference_tokens(
    tmp_path: Path, decodes: int
) -> None:
    out = tmp_path / "soak.json"
    argv = [sys.executable, str(SOAK), "--mix", "--requests", "500", "--concurrency", "24"]
    argv += ["--every", "250", "--num-blocks", "192", "--seed", "3", "--out", str(out)]
    argv += ["--decodes", str(decodes)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == 0 and result["mismatch_count"] == 0
    assert result["checked"] == 500 and result["sampled"] > 0
    # what the mix is for happened: aborts and closed connections, cache hits under evictions
    assert result["ends"]["abort"] > 0 and result["ends"]["close"] > 0
    assert result["prefix_cache"]["hit_tokens"] > 0 and result["prefix_cache"]["evictions"] > 0
    for role, pool in result["pools_at_end"].items():
        assert pool["owned"] == 0 and pool["leased"] == 0, (role, pool)
        assert pool["free"] == pool["total"] == 192, (role, pool)
    roles = ["prefill", "decode"] + [f"decode{i}" for i in range(1, decodes)]
    assert result["held_at_end"] == dict.fromkeys(roles, 0)
    assert result["exit_codes"] == dict.fromkeys(roles, 0)
    # every decode served: its pool caches blocks its pulls wrote
    assert all(result["pools_at_end"][r]["cached"] > 0 for r in roles[1:])


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_daemons_killed_under_traffic_leave_no_block_or_mapping_behind(
    tmp_path: Path, victim: str
) -> None:
    """--kill: a decode (each in turn) or the prefill is SIGKILLed and started again every
    second under the same mix. Requests on it end in LINK_LOST or a lost connection, with a
    prefix of the reference tokens; every other one is whole and equal to it; no pool holds a
    block at the end, and no daemon maps more shared memory than at its start (none kept a dead
    peer's pool)."""
    out = tmp_path / "soak.json"
    argv = [sys.executable, str(SOAK), "--mix", "--requests", "1200", "--concurrency", "24"]
    argv += ["--every", "600", "--num-blocks", "192", "--seed", "5", "--out", str(out)]
    argv += ["--decodes", "2", "--kill", victim, "--kill-every", "1"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["kills"]) >= 1 and {k["role"] for k in result["kills"]} <= {
        "prefill",
        "decode",
        "decode1",
    }
    assert all(k["role"].startswith(victim) for k in result["kills"])
    assert result["errors"] == 0 and result["mismatch_count"] == 0
    assert result["checked"] == 1200 and result["ends"]["lost"] == result["lost"]
    for role, pool in result["pools_at_end"].items():
        assert pool["owned"] == 0 and pool["leased"] == 0 and pool["free"] == 192, (role, pool)
    assert result["shm_mib_at_end"] == result["shm_mib_at_start"]
    assert set(result["exit_codes"].values()) == {0}
