"""bench/soak.py --mix through a real pair on CPU: shared prefixes, chunked long prompts, aborts and
closed connections under pool pressure leave no block held on either side, and every request's
tokens (those of one cut short: a prefix of them) equal the single-process reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def test_mixed_traffic_leaves_no_block_held_and_the_reference_tokens(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    argv = [sys.executable, str(SOAK), "--mix", "--requests", "500", "--concurrency", "24"]
    argv += ["--every", "250", "--num-blocks", "192", "--seed", "3", "--out", str(out)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == 0 and result["mismatch_count"] == 0
    assert result["checked"] == 500
    # what the mix is for happened: aborts and closed connections, cache hits under evictions
    assert result["ends"]["abort"] > 0 and result["ends"]["close"] > 0
    assert result["prefix_cache"]["hit_tokens"] > 0 and result["prefix_cache"]["evictions"] > 0
    for role, pool in result["pools_at_end"].items():
        assert pool["owned"] == 0 and pool["leased"] == 0, (role, pool)
        assert pool["free"] == pool["total"] == 192, (role, pool)
    assert result["held_at_end"] == {"prefill": 0, "decode": 0}
    assert result["exit_codes"] == {"prefill": 0, "decode": 0}
