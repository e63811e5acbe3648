"""The goodput side of bench/serve.py (DistServe's measure, issue 24 item 5).

A request meets the service-level objective when its TTFT is at most `ttft_ms` and its mean
inter-token latency (its TPOT: (E2E − TTFT) / (tokens − 1)) at most `itl_ms`; a failed request
never meets it. Per run, the attainment is the share of the run's requests that meet it and the
goodput in requests/s the number that met it over the run's duration. Per target over a sweep,
the goodput rate is the highest swept rate whose attainment is at least `attainment` (90 % by
default, as DistServe): what that deployment serves within the objective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path


def meets(request: dict, ttft_ms: float, itl_ms: float) -> bool:
    """Whether one request of a run's JSON (`RequestRecord.to_json`) met both bounds."""
    if not request["ok"] or request["ttft_ms"] is None:
        return False
    itl = request["itl_ms"]
    tpot = sum(itl) / len(itl) if itl else 0.0
    return request["ttft_ms"] <= ttft_ms and tpot <= itl_ms


def attainment(run: dict, ttft_ms: float, itl_ms: float) -> dict[str, float]:
    """The run's share of requests within the objective and its goodput in requests/s."""
    requests = run["requests"]
    met = sum(meets(r, ttft_ms, itl_ms) for r in requests)
    duration = run["summary"]["duration_s"]
    return {
        "attainment": met / len(requests) if requests else 0.0,
        "goodput_rps": met / duration if duration > 0 else 0.0,
    }


def goodput_rate(runs: Sequence[dict], target: str, share: float) -> float | None:
    """The highest swept rate at which `target` met the objective for at least `share` of its
    requests (None: at no rate)."""
    ok = [r["rate"] for r in runs if r["target"] == target and r["goodput"]["attainment"] >= share]
    return max(ok, default=None)


def add_goodput(runs: list[dict], ttft_ms: float, itl_ms: float) -> None:
    """Put each run's attainment and goodput into it (`run["goodput"]`)."""
    for run in runs:
        run["goodput"] = attainment(run, ttft_ms, itl_ms)


def print_goodput(runs: Sequence[dict], ttft_ms: float, itl_ms: float, share: float) -> None:
    targets = list(dict.fromkeys(r["target"] for r in runs))
    print(
        f"goodput: TTFT <= {ttft_ms:g} ms and mean ITL (TPOT) <= {itl_ms:g} ms per request; "
        f"attainment % (goodput req/s) by offered rate"
    )
    print(f"{'rate/s':>8} " + " ".join(f"{t:>18}" for t in targets))
    for rate in dict.fromkeys(r["rate"] for r in runs):
        cells = []
        for t in targets:
            run = next((r for r in runs if r["target"] == t and r["rate"] == rate), None)
            g = run["goodput"] if run else None
            cells.append(f"{g['attainment'] * 100:7.1f} % ({g['goodput_rps']:6.2f})" if g else "-")
        print(f"{rate:>8g} " + " ".join(f"{c:>18}" for c in cells))
    for t in targets:
        best = goodput_rate(runs, t, share)
        said = f"{best:g} req/s" if best is not None else "none of the swept rates"
        print(f"  {t}: highest rate with >= {share * 100:g} % within the objective: {said}")


def plot_goodput(runs: Sequence[dict], path: Path, ttft_ms: float, itl_ms: float) -> None:
    """Attainment against the offered rate, one line per target (finite rates only); nothing
    but a line saying so when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no goodput plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for target in dict.fromkeys(r["target"] for r in runs):
        pts = [
            (r["rate"], r["goodput"]["attainment"] * 100)
            for r in runs
            if r["target"] == target and math.isfinite(r["rate"])
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=target)
    ax.set(
        title=f"SLO attainment (TTFT <= {ttft_ms:g} ms, TPOT <= {itl_ms:g} ms)",
        xlabel="request rate (req/s)",
        ylabel="% of requests within the objective",
        ylim=(0, 105),
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"goodput plot: {path}")


__all__ = ["add_goodput", "attainment", "goodput_rate", "meets", "plot_goodput", "print_goodput"]
