"""bench/block_runs.py runs, and with FREE blocks about every handoff is one run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "block_runs.py"


def _mean(*args: str) -> float:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--requests", "400", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    m = re.search(r"(\d+) handoffs, runs per handoff: mean ([\d.]+)", out)
    assert m is not None and int(m.group(1)) > 300, out
    return float(m.group(2))


def test_handoffs_come_in_runs_under_churn():
    assert _mean() < 1.1  # the free stack before FreeRuns: 11.7
    assert 1.0 <= _mean("--cache") < 3.3  # 3.09; FREE blocks ahead of evicted ones: 3.50
