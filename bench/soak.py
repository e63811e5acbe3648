"""Soak test (not CI): N requests through a real prefill/decode pair on CPU, bounded concurrency.

Every K requests it samples RSS and open fds of both daemons (/proc), prints a table and writes
JSON; at the end both pools must report every block free. Exit 0 when the soak was clean.

    .venv/bin/python bench/soak.py --requests 10000 --concurrency 32 --every 1000 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from common import client
from common.model.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def start(runtime: Path, role: str, *args: str) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "pdkv.cli",
        "--runtime-dir",
        str(runtime),
        "--log-format",
        "json",
        "--log-level",
        "WARNING",
        role,
        "start",
        "--device",
        "cpu",
        *args,
    ]
    log = open(runtime / f"{role}.log", "ab")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


async def wait_up(sock: Path, linked: bool = False, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            st = await client.status(str(sock), timeout=1)
            if not linked or st.links[0]["state"] == "up":
                return
        except Exception:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit(f"{sock} did not come up in {timeout}s")


def sample(pid: int) -> dict[str, float]:
    p = psutil.Process(pid)
    return {"rss_mib": round(p.memory_info().rss / 2**20, 1), "fds": p.num_fds()}


async def soak(args: argparse.Namespace, runtime: Path) -> dict:
    procs = {"decode": start(runtime, "decode"), "prefill": start(runtime, "prefill")}
    await wait_up(runtime / "decode.sock")
    await wait_up(runtime / "prefill.sock", linked=True)
    sock = str(runtime / "prefill.sock")
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.concurrency)
    done = errors = tokens = 0
    rows: list[dict] = []
    t0 = time.monotonic()

    def row() -> None:
        d, p = sample(procs["decode"].pid), sample(procs["prefill"].pid)
        rows.append(
            {
                "requests": done,
                "errors": errors,
                "elapsed_s": round(time.monotonic() - t0, 1),
                "prefill_rss_mib": p["rss_mib"],
                "prefill_fds": p["fds"],
                "decode_rss_mib": d["rss_mib"],
                "decode_fds": d["fds"],
            }
        )
        print("  ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)

    async def one(i: int) -> None:
        nonlocal done, errors, tokens
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 80))]
        params = SamplingParams(max_tokens=rng.randrange(1, args.max_tokens + 1), ignore_eos=True)
        async with sem:
            try:
                res = await client.generate(sock, prompt_tokens=prompt, sampling=params, timeout=60)
                tokens += len(res.tokens)
            except Exception as exc:
                errors += 1
                print(f"request {i} failed: {exc}", file=sys.stderr)
        done += 1
        if done % args.every == 0:
            row()

    row()
    await asyncio.gather(*(one(i) for i in range(args.requests)))
    elapsed = time.monotonic() - t0
    await asyncio.sleep(0.5)
    pools = {r: (await client.status(str(runtime / f"{r}.sock"))).pool for r in procs}
    codes = {}
    for role in ("prefill", "decode"):  # prefill first: it must not see its link drop mid-stop
        procs[role].send_signal(signal.SIGTERM)
        try:
            codes[role] = procs[role].wait(timeout=60)
        except subprocess.TimeoutExpired:
            procs[role].kill()
            codes[role] = f"hung after SIGTERM (killed), rc {procs[role].wait()}"
    all_free = all(pl["free"] == pl["total"] for pl in pools.values())
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "errors": errors,
        "tokens": tokens,
        "elapsed_s": round(elapsed, 1),
        "req_per_s": round(args.requests / elapsed, 1),
        "tok_per_s": round(tokens / elapsed, 1),
        "samples": rows,
        "pools_at_end": pools,
        "all_free": all_free,
        "exit_codes": codes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--every", type=int, default=1000, help="sample RSS/fds every K requests")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("soak.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdkv-soak-") as tmp:
        os.chmod(tmp, 0o700)
        result = asyncio.run(soak(args, Path(tmp)))
    args.out.write_text(json.dumps(result, indent=2))
    first, last = result["samples"][0], result["samples"][-1]
    print(
        f"\n{result['requests']} requests, {result['errors']} errors, {result['elapsed_s']} s, "
        f"{result['req_per_s']} req/s, {result['tok_per_s']} tok/s"
    )
    print(f"{'':10}{'RSS MiB first':>15}{'RSS MiB last':>14}{'fds first':>11}{'fds last':>10}")
    for r in ("prefill", "decode"):
        print(
            f"{r:10}{first[r + '_rss_mib']:>15}{last[r + '_rss_mib']:>14}"
            f"{first[r + '_fds']:>11}{last[r + '_fds']:>10}"
        )
    print(
        f"pools at end: {result['pools_at_end']}  all free: {result['all_free']}  "
        f"exit codes: {result['exit_codes']}  -> {args.out}"
    )
    ok = result["all_free"] and not result["errors"] and set(result["exit_codes"].values()) == {0}
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
