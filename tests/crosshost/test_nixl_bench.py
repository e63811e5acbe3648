"""bench/nixl_handoff.py runs end to end on this machine (tiny sizes) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_the_nixl_handoff_bench_writes_every_path_and_pattern(tmp_path: Path):
    out = tmp_path / "nixl.json"
    argv = [sys.executable, "bench/nixl_handoff.py", "--device", "cpu", "--tokens", "48"]
    argv += ["--iters", "2", "--warmup", "1", "--out", str(out)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"push", "pull"}  # no CUDA-IPC row without CUDA
    for pats in data["results"].values():
        assert pats["scattered"]["runs"] == 3 and pats["contiguous"]["runs"] == 1
        assert all(r["bytes"] == 3 * 360_448 and r["gb_per_s"] > 0 for r in pats.values())
    assert "push" in res.stdout and "GB/s" in res.stdout
