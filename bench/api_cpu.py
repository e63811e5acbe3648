"""The HTTP API's own CPU per streamed token, with many streams in flight.

Starts a decode daemon, a prefill daemon and the API (the real CLI, CPU, the tiny model), then
runs `--rounds` rounds of `--streams` concurrent streamed POST /v1/completions (greedy,
`ignore_eos`, `--tokens` tokens each), each on its own kept-alive HTTP connection (the minimal
client of bench/api_overhead.py, so the client costs as little as a client can). The figure is
the API's CPU time (utime + stime from /proc, which other jobs on a shared machine do not
inflate; with `--workers N` the supervisor's and its workers' together) per streamed token, per
round, and its busiest process's share of a core; the prefill daemon's is printed beside it, as is the
number of SSE events a stream got (fewer than its tokens when the API fell behind and the client
library merged queued frames).

    .venv/bin/python bench/api_cpu.py [--streams 128] [--tokens 256] [--rounds 3] [--workers 1]
        [--out r.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from api_overhead import Http, start, wait_up
from serve_api import free_port
from serve_daemons import tree_cpu_s

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


async def one(port: int, tokens: int) -> int:
    """One streamed completion; the number of SSE events that carried text."""
    body = {
        "model": "pdkv-tiny",
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    events = 0
    async with Http(port) as api:
        async for chunk in api.stream(body):
            events += bool(chunk["choices"][0]["text"])
    return events


async def measure(rt: Path, port: int, args: argparse.Namespace, pids: dict[str, int]) -> dict:
    await wait_up(str(rt / "prefill.sock"), f"http://127.0.0.1:{port}")
    await asyncio.gather(*(one(port, 8) for _ in range(min(args.streams, 16))))  # warm-up
    rounds = []
    for r in range(args.rounds):
        cpu0 = {k: tree_cpu_s(pid) for k, pid in pids.items()}
        t0 = time.perf_counter()
        events = await asyncio.gather(*(one(port, args.tokens) for _ in range(args.streams)))
        wall = time.perf_counter() - t0
        n = args.streams * args.tokens
        used = {
            k: [tree_cpu_s(pid).get(p, s) - s for p, s in cpu0[k].items()]
            for k, pid in pids.items()
        }
        got = {f"{k}_cpu_us_per_token": sum(u) / n * 1e6 for k, u in used.items()}
        got |= {
            "wall_s": wall,
            "tokens_per_s": n / wall,
            "events_per_stream": statistics.mean(events),
            "api_busiest_core_share": max(used["api"]) / wall,
        }
        rounds.append(got)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    return {"rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="the API's --workers")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rt = Path(tempfile.mkdtemp(prefix="pdkv-apicpu-"))
    os.chmod(rt, 0o700)
    port = free_port()
    blocks = str(args.streams * (args.tokens // 16 + 4) + 64)
    batch = str(args.streams)
    procs = {
        "decode": start(
            rt, "decode", "start", "--device", "cpu", "--num-blocks", blocks, "--max-batch", batch
        ),
        "prefill": start(rt, "prefill", "start", "--device", "cpu", "--num-blocks", blocks),
        "api": start(rt, "api", "start", "--port", str(port), "--workers", str(args.workers)),
    }
    try:
        pids = {k: procs[k].pid for k in ("api", "prefill")}
        res = asyncio.run(measure(rt, port, args, pids))
    finally:
        for p in reversed(procs.values()):
            p.terminate()
            p.wait(timeout=30)
        shutil.rmtree(rt, ignore_errors=True)
    per_token = [r["api_cpu_us_per_token"] for r in res["rounds"]]
    res |= {
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "streams": args.streams,
        "workers": args.workers,
        "tokens": args.tokens,
        "api_cpu_us_per_token_median": statistics.median(per_token),
    }
    print(
        f"API CPU per token, median of {args.rounds} rounds: {res['api_cpu_us_per_token_median']:.1f} us"
    )
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
