"""bench/structured_ttft.py through a real pair on CPU (the tiny model): every request of every
kind answered, and the result file holds what its table is made of (the timings themselves are
the bench's to report, not a test's to judge)."""

from __future__ import annotations

import json
from pathlib import Path

import structured_ttft


def test_the_bench_times_every_kind_and_reports_the_daemons_stages(tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    structured_ttft.TIMINGS.update({k: [] for k in structured_ttft.KINDS})
    assert structured_ttft.main(["--model", "tiny", "--schemas", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {k: len(v) for k, v in result["ms"].items()} == dict.fromkeys(structured_ttft.KINDS, 4)
    assert all(t > 0 for v in result["ms"].values() for t in v)
    assert result["cached_p50_ms"] > 0 and "first_minus_plain_p50_ms" in result
    # FINISH's timings of each kind came back, the admission among them
    stages = result["stages"]
    assert set(stages) == set(structured_ttft.KINDS)
    assert all(stages[k]["prefill_admit_us"] > 0 for k in structured_ttft.KINDS)
