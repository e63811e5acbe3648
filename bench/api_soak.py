"""Soak of the HTTP API's workers: requests through `pdkv api start --workers N` while a worker
is SIGKILLed every `--kill-every` seconds.

Starts a CPU pair and the API (the real CLI, the tiny model), then sends `--requests` greedy
completions (`ignore_eos`, 16 tokens, half of them streamed) over fresh connections, at most
`--concurrency` at once, 40 distinct prompts in turn. Clean when: every request that succeeds
gives the text every other request with its prompt got; every failure is a connection that broke
(a killed worker's); the API is still up at the end and stops cleanly; and neither daemon holds
a block (OWNED or LEASED) or a request afterwards (each killed worker's requests were aborted),
and both stop cleanly. Exit 0 when clean.

Only a worker that has begun to serve (its `api_worker_serving` line in the API's log) is killed:
the supervisor ends the API after MAX_EXITS_BEFORE_SERVING workers in a row exit before they
serve (a worker that fails at start, every time), and a kill a second on a loaded machine, where
a worker takes longer than that to start, made that happen.

    .venv/bin/python bench/api_soak.py [--requests 4000] [--workers 2] [--kill-every 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common.daemon.rundir import child_pids

TOKENS = 16
#: what a request on a killed worker fails with: its connection broke (httpx's names)
BROKEN = {"RemoteProtocolError", "ReadError", "WriteError", "ConnectError"}


def serving_workers(log: Path, supervisor: int) -> list[int]:
    """Pids of the API's live workers that have begun to serve: each `api_worker_started` line
    (the supervisor's: worker index, pid) then that worker's `api_worker_serving` line."""
    pid_of: dict[int, int] = {}
    serving: set[int] = set()
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:  # a line still being written
            continue
        if event.get("event") == "api_worker_started":
            pid_of[event["worker"]] = event["pid"]
        elif event.get("event") == "api_worker_serving" and event.get("worker") in pid_of:
            serving.add(pid_of[event["worker"]])
    return sorted(serving.intersection(child_pids(supervisor)))


def cli(rt: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(rt), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


async def one(http: httpx.AsyncClient, url: str, prompt: str, stream: bool) -> str:
    """One completion's text; RuntimeError on an HTTP or in-stream error."""
    body = {"model": "pdkv-tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "stream": stream}
    if not stream:
        resp = await http.post(url + "/v1/completions", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}")
        return resp.json()["choices"][0]["text"]
    text = ""
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}")
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"error event {event['error'].get('code')}")
                text += "".join(c.get("text", "") for c in event.get("choices", []))
    return text


async def soak(supervisor: int, log: Path, url: str, args: argparse.Namespace) -> dict:
    prompts = [f"prompt {i} " * (1 + i % 7) for i in range(40)]
    texts: dict[str, str] = {}
    failures: dict[str, int] = {}
    wrong: list[dict] = []
    kills: list[int] = []
    done = asyncio.Event()

    async def killer() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), args.kill_every)
            if not done.is_set() and (pids := serving_workers(log, supervisor)):
                pid = random.choice(pids)
                os.kill(pid, signal.SIGKILL)
                kills.append(pid)

    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=0)
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits, trust_env=False) as http:

        async def request(i: int) -> None:
            prompt = prompts[i % len(prompts)]
            async with gate:
                try:
                    text = await one(http, url, prompt, stream=i % 2 == 0)
                except (httpx.TransportError, RuntimeError) as exc:
                    key = f"{type(exc).__name__}: {str(exc)[:60]}"
                    failures[key] = failures.get(key, 0) + 1
                    return
            if texts.setdefault(prompt, text) != text:
                wrong.append({"request": i, "prompt": prompt, "want": texts[prompt], "got": text})

        task = asyncio.create_task(killer())
        t0 = time.monotonic()
        await asyncio.gather(*(request(i) for i in range(args.requests)))
        wall = time.monotonic() - t0
        done.set()
        await task
    ok = args.requests - sum(failures.values())
    return {"ok": ok, "failures": failures, "wrong": wrong, "kills": len(kills), "wall_s": wall}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kill-every", type=float, default=3.0, help="seconds between kills")
    ap.add_argument("--out", type=Path)
    return ap.parse_args(argv)


def held(status: dict) -> dict[str, dict[str, int]]:
    """What each daemon holds, from `pdkv status --json`: blocks OWNED and LEASED, requests."""
    return {
        r: {k: status[r]["pool"][k] for k in ("owned", "leased")}
        | {"requests": status[r]["inflight"]}
        for r in ("prefill", "decode")
    }


def total(holdings: dict[str, dict[str, int]]) -> int:
    return sum(v for d in holdings.values() for v in d.values())


def run(args: argparse.Namespace) -> dict:
    """The pair and the API started in a fresh runtime dir, the soak, the daemons' holdings, the
    API stopped; the result (`clean` its verdict), printed and written to --out if given."""
    rt = Path(tempfile.mkdtemp(prefix="pdkv-apisoak-"))
    os.chmod(rt, 0o700)
    try:
        for role in ("decode", "prefill"):
            started = cli(rt, role, "start", "--background")
            assert started.returncode == 0, started.stderr
        started = cli(
            rt, "api", "start", "--background", "--port", "0", "--workers", str(args.workers)
        )
        assert started.returncode == 0, started.stderr
        url = re.search(r"(http://\S+)/v1", started.stdout).group(1)
        supervisor = int(re.search(r"pid (\d+)", started.stdout).group(1))
        log = Path(re.search(r"log (\S+)", started.stdout).group(1))
        res = asyncio.run(soak(supervisor, log, url, args))
        deadline = time.monotonic() + 10.0
        while True:  # until the killed workers' aborts have reached the daemons
            status = json.loads(cli(rt, "status", "--json").stdout)
            res["held"] = held(status)
            if not total(res["held"]) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        res["api_up"] = bool(status.get("apis"))
        res["api_stopped"] = cli(rt, "stop", "api").returncode == 0
        res["daemons_stopped"] = cli(rt, "stop").returncode == 0
    finally:
        cli(rt, "stop")  # what still runs after a failure on the way
        shutil.rmtree(rt, ignore_errors=True)
    failures_ok = all(k.split(":")[0] in BROKEN for k in res["failures"])
    res["clean"] = bool(
        not res["wrong"]
        and failures_ok
        and res["api_up"]
        and res["api_stopped"]
        and res["daemons_stopped"]
        and not total(res["held"])
    )
    print(
        f"{args.requests} requests in {res['wall_s']:.0f} s through {args.workers} workers, "
        f"{res['kills']} killed: {res['ok']} ok, failed {res['failures'] or 0}, "
        f"{len(res['wrong'])} with another text, held afterwards {res['held']}, "
        f"API up {res['api_up']}, stopped cleanly {res['api_stopped']}, "
        f"daemons stopped cleanly {res['daemons_stopped']}: "
        + ("clean" if res["clean"] else "NOT CLEAN")
    )
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    return res


def main() -> int:
    return 0 if run(parse_args())["clean"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
