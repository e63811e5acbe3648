"""How long the prefill leaves its device idle between forwards while prompts wait.

Reads prefill daemon logs (JSON lines at INFO: bench/serve.py with PDKV_BENCH_LOGS=DIR keeps
them as DIR/pairN-prefill.log) and sums, per log, the forwards' wall time and the gaps between a
forward's return and the next one's start when that next batch was already queued
(`prefill_batch`'s `queued_gap_ms`): the first tokens, KV_READYs and relays the daemon's loop
runs in between. A gap of 0.6 ms after 9 ms forwards is 6 % of the prefill's share of the device.

    PDKV_BENCH_LOGS=/tmp/logs .venv/bin/python bench/serve.py --nano --target daemons ...
    .venv/bin/python bench/forward_gaps.py /tmp/logs/pair*-prefill.log [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def gaps(log: Path) -> dict:
    """One log's forwards: how many, their total ms, and the queued gaps' count, total ms,
    share of (forwards + gaps) while queued, p50 and max."""
    forward_ms, gap_ms, queued_forward_ms = [], [], []
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") != "prefill_batch":
            continue
        forward_ms.append(float(event["forward_ms"]))
        if event.get("queued_gap_ms") is not None:
            gap_ms.append(float(event["queued_gap_ms"]))
            queued_forward_ms.append(float(event["forward_ms"]))
    busy = sum(queued_forward_ms) + sum(gap_ms)
    return {
        "log": str(log),
        "forwards": len(forward_ms),
        "forward_ms": round(sum(forward_ms), 3),
        "queued_gaps": len(gap_ms),
        "gap_ms": round(sum(gap_ms), 3),
        "gap_share": round(sum(gap_ms) / busy, 4) if busy else 0.0,
        "gap_p50_ms": round(statistics.median(gap_ms), 3) if gap_ms else 0.0,
        "gap_max_ms": round(max(gap_ms), 3) if gap_ms else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path, help="prefill daemon logs (JSON lines)")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args()
    rows = [gaps(log) for log in args.logs]
    for r in rows:
        print(
            f"{r['log']}: {r['forwards']} forwards, {r['forward_ms']} ms; queued behind another: "
            f"{r['queued_gaps']}, idle between them {r['gap_ms']} ms = {r['gap_share']:.1%} of "
            f"that span (p50 {r['gap_p50_ms']} ms, max {r['gap_max_ms']} ms)"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if rows and any(r["forwards"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
