"""The report side of bench/serve.py: the table, the same-output check and the sweep's plot."""

from __future__ import annotations

import math
from pathlib import Path


def _ms(d: dict, key: str) -> str:
    v = d[key]
    return f"{v:9.1f}" if v is not None else f"{'-':>9}"


def print_table(runs: list[dict]) -> None:
    head = f"{'target':8} {'rate/s':>7} {'done':>9} {'req/s':>7} {'out tok/s':>9}"
    head += "".join(f" {m + ' ' + q:>9}" for m in ("TTFT", "ITL", "E2E") for q in ("p50", "p99"))
    print(head + "   (latencies in ms)")
    for run in runs:
        s = run["summary"]
        line = f"{run['target']:8} {run['rate']:7g} {s['completed']:>4}/{s['requests']:<4}"
        line += f" {s['request_throughput']:7.2f} {s['output_throughput']:9.1f}"
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            line += _ms(s[key], "p50") + _ms(s[key], "p99")
        print(line)
        second = s.get("second_token_ms", {})
        if second.get("p50") is not None:
            print(
                f"    2nd token after the 1st, ms: p50 {second['p50']:.2f}  p99 {second['p99']:.2f}"
            )
        lag = s.get("send_lag_ms", {})
        if lag.get("p99") is not None and lag["p99"] >= 0.1:  # the client itself fell behind
            print(f"    sent late by the client, ms: p50 {lag['p50']:.2f}  p99 {lag['p99']:.2f}")
        server = s.get("server_timings") or {}
        if server:
            parts = [f"{k} {d['p50']:.1f}/{d['p99']:.1f}" for k, d in server.items()]
            print("    server's own timings p50/p99: " + ", ".join(parts))
        if "server_cpu_us_per_token" in s:
            print(
                f"    the API's CPU (its workers' too): {s['server_cpu_us_per_token']:.1f} us a token,"
                f" its busiest process {s['server_cpu_share']:.0%} of a core"
            )
        if "pulled_blocks" in s:
            print(
                f"    KV pulled by the decode: {s['pulled_blocks']} blocks, {s['pulled_mib']} MiB"
            )
        by_turn = s.get("ttft_ms_by_turn") or {}
        if by_turn:
            parts = [f"{t}: {d['p50']:.1f}" for t, d in by_turn.items() if d["p50"] is not None]
            print("    TTFT p50 by turn, ms: " + ", ".join(parts))
        for err in s["errors"]:
            print(f"    error: {err}")


def same_output(runs: list[dict], *, tiny: bool) -> None:
    """Print, per rate run on both targets, how many requests got the same tokens from each
    (greedy: all of them where batching does not change the rounding, as on CPU in fp32); and
    with the tiny model, how many got from the api the text of the daemons' tokens."""
    from common.model.tokenizer import ByteTokenizer

    by_key = {(r["target"], r["rate"]): r["requests"] for r in runs}
    for rate in dict.fromkeys(r["rate"] for r in runs):
        d = by_key.get(("daemons", rate))
        for other in ("local", "daemons-no-cache"):
            theirs = by_key.get((other, rate))
            if d and theirs:
                same = sum(a["tokens"] == b["tokens"] for a, b in zip(d, theirs, strict=True))
                print(
                    f"same tokens from daemons and {other} at {rate:g}/s: {same}/{len(d)} requests"
                )
        api = by_key.get(("api", rate))
        if d and api and tiny:
            decode = ByteTokenizer().decode
            same = sum(decode(a["tokens"]) == b["text"] for a, b in zip(d, api, strict=True))
            print(f"same text from api as daemons' tokens at {rate:g}/s: {same}/{len(d)} requests")


def plot(runs: list[dict], path: Path) -> None:
    """p99 TTFT and p99 ITL against the rate, one line per target (finite rates only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib); figures above")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(axes, ("ttft_ms", "itl_ms"), ("p99 TTFT", "p99 ITL"), strict=True):
        for target in sorted({r["target"] for r in runs}):
            pts = [
                (r["rate"], r["summary"][key]["p99"])
                for r in runs
                if r["target"] == target and math.isfinite(r["rate"])
            ]
            ax.plot(*zip(*pts, strict=True), marker="o", label=target)
        rates = sorted({r["rate"] for r in runs if math.isfinite(r["rate"])})
        ax.set(title=title, xlabel="request rate (req/s)", ylabel="ms", xscale="log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates], minor=False)
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
