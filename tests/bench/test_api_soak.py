"""bench/api_soak.py through real daemons and a real two-worker API on CPU: with workers killed
under it, every answered request has its prompt's one greedy text, every failure is a broken
connection, the API stays up and stops cleanly, and no daemon holds a block afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "bench" / "api_soak.py"


def test_killed_workers_lose_only_their_own_requests(tmp_path: Path) -> None:
    out = tmp_path / "api_soak.json"
    argv = [sys.executable, str(SOAK), "--requests", "1200", "--kill-every", "1.0"]
    run = subprocess.run([*argv, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["clean"] and res["kills"] >= 1 and res["wrong"] == []
    assert res["ok"] >= 600  # most requests reach a live worker
    assert (
        res["held"]["prefill"]
        == res["held"]["decode"]
        == {
            "owned": 0,
            "leased": 0,
            "requests": 0,
        }
    )
