"""Summarize bench/serve.py JSON files side by side: TTFT, the 2nd token (the first inter-token
gap, from each request's client timings) and the decode's own stage timings, p50 each.

    python bench/ab_summary.py gpu-results/ab_*.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

STAGES = (
    "handoff_after_first_us",
    "usable_us",
    "first_wait_us",
    "first_read_us",
    "wire_us",
    "read_us",
    "admit_us",
    "enqueue_us",
    "join_us",
    "first_launch_us",
    "first_sync_us",
    "later_step_us",
    "pull_us",
    "first_step_us",
)


def summarize(path: Path) -> str:
    report = json.loads(path.read_text())
    parts = []
    for run in report["runs"]:
        reqs = [q for q in run["requests"] if q.get("ok", True)]
        ttft = statistics.median(q["ttft_ms"] for q in reqs)
        second = [q["itl_ms"][0] for q in reqs if q.get("itl_ms")]
        line = f"{path.stem}/{run.get('target', '?')}: n={len(reqs)} TTFT p50 {ttft:.2f} ms"
        if second:
            line += f", 2nd token p50 {statistics.median(second):.2f} ms"
        timings = [q.get("server_timings") or {} for q in reqs]
        for key in STAGES:
            xs = [t[key] for t in timings if key in t]
            if xs:
                line += f", {key} {statistics.median(xs):.0f}"
        parts.append(line)
    return "\n".join(parts)


def main() -> None:
    for arg in sys.argv[1:]:
        print(summarize(Path(arg)))


if __name__ == "__main__":
    main()
