"""bench/soak.py --mix through real daemons on CPU (a prefill and one or two decodes): shared
prefixes, chunked long prompts, seeded sampling, aborts and closed connections under pool pressure
leave no block held on any side, and every request's tokens (those of one cut short: a prefix of
them) equal the single-process reference; every daemon stops with exit 0."""

from __future__ import annotations

from pathlib import Path

import pytest
import soak


def run(tmp_path: Path, *argv: str) -> dict:
    """bench/soak.py with these arguments: its result (in tmp_path too, and the daemons' logs
    where a request did not match)."""
    return soak.run(soak.parse_args([*argv, "--out", str(tmp_path / "soak.json")]))


@pytest.mark.parametrize("decodes", [1, 2])
def test_mixed_traffic_leaves_no_block_held_and_the_reference_tokens(
    tmp_path: Path, decodes: int
) -> None:
    argv = ["--mix", "--requests", "500", "--concurrency", "24", "--every", "250"]
    result = run(tmp_path, *argv, "--num-blocks", "192", "--seed", "3", "--decodes", str(decodes))
    assert result["errors"] == 0 and result["mismatch_count"] == 0, result["mismatches"]
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
    assert soak.clean(result)  # what bench/soak.py exits 0 on, the shared memory mapped included


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_daemons_killed_under_traffic_leave_no_block_or_mapping_behind(
    tmp_path: Path, victim: str
) -> None:
    """--kill: a decode (each in turn) or the prefill is SIGKILLed and started again every
    second under the same mix. Requests on it end in LINK_LOST or a lost connection, with a
    prefix of the reference tokens; every other one is whole and equal to it; no pool holds a
    block at the end, and no daemon maps more shared memory than at its start (none kept a dead
    peer's pool)."""
    argv = ["--mix", "--requests", "600", "--concurrency", "24", "--every", "300"]
    argv += ["--num-blocks", "192", "--seed", "5", "--decodes", "2"]
    result = run(tmp_path, *argv, "--kill", victim, "--kill-every", "1")
    assert len(result["kills"]) >= 1 and {k["role"] for k in result["kills"]} <= {
        "prefill",
        "decode",
        "decode1",
    }
    assert all(k["role"].startswith(victim) for k in result["kills"])
    assert result["errors"] == 0 and result["mismatch_count"] == 0, result["mismatches"]
    assert result["checked"] == 600 and result["ends"]["lost"] == result["lost"]
    for role, pool in result["pools_at_end"].items():
        assert pool["owned"] == 0 and pool["leased"] == 0 and pool["free"] == 192, (role, pool)
    assert result["shm_mib_at_end"] == result["shm_mib_at_start"]
    assert set(result["exit_codes"].values()) == {0}
    assert soak.clean(result)
