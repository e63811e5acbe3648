"""Handoff latency through both real daemons, as a client sees the system (CPU, shm backend).

Starts a decode and a prefill daemon (the real CLI, `--spin-us` as given), sends `--requests`
generations one after another (64-token prompts, max_tokens=2, so every request is handed off
and decoded), and reads the timings each FINISH carries: `handoff_us` (prefill: HANDOFF sent →
RELEASE received), `decode_handoff_us` (HANDOFF sent → the decode holds the KV) and `pull_us`
(the decode's own part of that: HANDOFF read → KV in its pool). Unlike bench/cpu_handoff.py,
whose handoffs follow each other back to back, every handoff here comes between a client's
request, a prefill forward pass and a decode step: the code on the path runs cold.

`--pin` puts the decode daemon on the last CPU and the prefill daemon and this client on the
others (docs/operations.md, "CPU placement": on a 2-vCPU VM the RELEASE otherwise waits for the
CPU behind the decode's own step).

    .venv/bin/python bench/daemon_handoff.py [--requests 500] [--spin-us 0] [--pin] [--out r.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import client
from common.sampling_params import SamplingParams

_KEYS = ("handoff_us", "decode_handoff_us", "first_read_us", "pull_us", "enqueue_us")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def start(rt: Path, role: str, spin_us: int, cpus: set[int] | None = None) -> subprocess.Popen:
    log = open(rt / f"{role}.log", "wb")  # noqa: SIM115
    argv = [
        sys.executable,
        "-m",
        "pdkv.cli",
        "--runtime-dir",
        str(rt),
        "--log-format",
        "json",
    ]
    argv += ["--log-level", "WARNING", role, "start", "--device", "cpu", "--spin-us", str(spin_us)]
    proc = subprocess.Popen(argv, stdout=log, stderr=log)
    if cpus:  # before the interpreter has started a thread: every later one inherits it
        os.sched_setaffinity(proc.pid, cpus)
    return proc


async def wait_up(sock: str, linked: bool) -> None:
    for _ in range(1200):
        try:
            st = await client.status(sock, timeout=1)
            if not linked or st.links[0]["state"] == "up":
                return
        except (OSError, TimeoutError, IndexError, client.PdkvError):
            pass
        await asyncio.sleep(0.05)
    raise SystemExit(f"{sock} did not come up")


async def measure(rt: Path, requests: int, warmup: int) -> dict[str, list[float]]:
    await wait_up(str(rt / "decode.sock"), linked=False)
    await wait_up(str(rt / "prefill.sock"), linked=True)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    got: dict[str, list[float]] = {k: [] for k in _KEYS}
    for i in range(warmup + requests):
        prompt = [(i + j) % 250 for j in range(64)]
        res = await client.generate(str(rt / "prefill.sock"), prompt_tokens=prompt, sampling=params)
        assert res.finish is not None and len(res.tokens) == 2, res
        if i >= warmup:  # first_read_us only after an early HANDOFF (KV_READY)
            for k in _KEYS:
                if k in res.finish.timings:
                    got[k].append(res.finish.timings[k])
    return {k: v for k, v in got.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--spin-us", type=int, default=0)
    ap.add_argument("--pin", action="store_true", help="decode on the last CPU, the rest elsewhere")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    last = max(os.sched_getaffinity(0))
    decode_cpus = {last} if args.pin else None
    others = os.sched_getaffinity(0) - {last} if args.pin else None
    if others:
        os.sched_setaffinity(0, others)
    rt = Path(tempfile.mkdtemp(prefix="pdkv-dh-"))
    os.chmod(rt, 0o700)
    procs = [
        start(rt, "decode", args.spin_us, decode_cpus),
        start(rt, "prefill", args.spin_us, others),
    ]
    try:
        got = asyncio.run(measure(rt, args.requests, args.warmup))
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=30)
    res = {
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}",
        "date": time.strftime("%Y-%m-%d"),
        "spin_us": args.spin_us,
        "pinned": args.pin,
        "requests": args.requests,
        "results": {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in got.items()},
    }
    pinned = ", decode pinned apart" if args.pin else ""
    print(
        f"handoff through the daemons, {res['machine']}, {res['date']}, "
        f"spin {args.spin_us} us{pinned}"
    )
    for k, v in res["results"].items():
        print(f"  {k:18} p50 {v['p50']:9.1f} us   p99 {v['p99']:9.1f} us")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
