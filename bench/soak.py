"""Soak test: N requests through a real prefill/decode pair on CPU, bounded concurrency.

Every K requests it samples RSS and open fds of both daemons (/proc), prints a table and writes
JSON; at the end both pools must report every block free. Exit 0 when the soak was clean.

`--mix` makes the traffic what leaks blocks if anything does: a third of the prompts start with
one of four shared prefixes (prefix-cache hits, blocks shared by requests in flight together),
one in twenty is long enough to be chunked (the prefill runs at most `--max-prefill-tokens`
positions a forward), one request in six is aborted by its client after its first tokens and
one in twelve has its connection closed under it; `--num-blocks` small enough puts both pools
under pressure (waits, evictions). Then every request that completed must have the tokens of
the single-process reference (`common.model.reference`, greedy: the same tokens whatever the
cache, the batch or the aborts around it), and at the end neither daemon may hold a block
(OWNED or LEASED) or a request. Prefix-cache blocks may stay CACHED: that is the cache.

    .venv/bin/python bench/soak.py --requests 10000 --concurrency 32 --every 1000 --out soak.json
    .venv/bin/python bench/soak.py --mix --requests 2000 --num-blocks 384 --out soak-mix.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from common.protocol import Tokens

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


#: --mix: the shared prefixes' lengths (a multiple of the block size and not) and how a request
#: ends: run to its FINISH, aborted by its client after its first tokens, its connection closed
PREFIX_LENS = (16, 40, 64, 150)
HOWS = ("whole",) * 9 + ("abort", "abort", "close")


def draw(rng: random.Random, mix: bool, max_tokens: int, prefixes: list[list[int]]) -> tuple:
    """One request: (prompt, max_tokens, how)."""
    m = rng.randrange(1, max_tokens + 1)
    if not mix:
        return [rng.randrange(256) for _ in range(rng.randrange(1, 80))], m, "whole"
    roll = rng.random()
    if roll < 1 / 3:  # a shared prefix, then 0-40 tokens of its own (0: the whole prompt cached)
        own = [rng.randrange(256) for _ in range(rng.randrange(0, 41))]
        prompt = rng.choice(prefixes) + own
    elif roll < 1 / 3 + 1 / 20:  # long: chunked
        prompt = [rng.randrange(256) for _ in range(rng.randrange(300, 700))]
    else:
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 80))]
    how = rng.choice(HOWS)
    return prompt, (max(m, 2) if how != "whole" else m), how


async def run_one(
    conn: client.Connection, sock: str, prompt: list[int], m: int, how: str
) -> tuple[list[int], bool]:
    """(the tokens received, whether the request ran to its FINISH)."""
    params = SamplingParams(max_tokens=m, ignore_eos=True)
    own = client.Connection(sock) if how == "close" else conn
    got: list[int] = []
    stream = own.stream(prompt_tokens=prompt, sampling=params, timeout=60, text_deltas=False)
    async with contextlib.aclosing(stream) as frames:
        async for msg in frames:
            if isinstance(msg, Tokens):
                got.extend(msg.tokens)
                if got and how == "abort":
                    return got, False  # aclosing sends ABORT
                if got and how == "close":
                    own.close()  # the daemon aborts everything the connection had
                    return got, False
            else:
                return got, True
    return got, False


async def settled(runtime: Path, roles: list[str], timeout: float = 10.0) -> dict:
    """Each daemon's STATUS once it holds no block (OWNED or LEASED) and no request, or at the
    timeout as it is then."""
    deadline = time.monotonic() + timeout
    while True:
        replies = {r: await client.status(str(runtime / f"{r}.sock")) for r in roles}
        clean = all(
            st.pool["owned"] == 0 and st.pool["leased"] == 0 and st.inflight == 0
            for st in replies.values()
        )
        if clean or time.monotonic() > deadline:
            return {r: {"pool": st.pool, "inflight": st.inflight} for r, st in replies.items()}
        await asyncio.sleep(0.1)


def check_tokens(completed: dict[tuple, list[list[int]]]) -> list[dict]:
    """Every request's tokens against the single-process reference: the whole output for one that
    finished, a prefix of it for one cut short. The mismatches."""
    import torch

    from common.model import load_model, reference

    torch.set_num_threads(1)
    model, _ = load_model(None)
    bad = []
    for (prompt, m), outputs in completed.items():
        want = reference.generate(
            model, list(prompt), SamplingParams(max_tokens=m, ignore_eos=True)
        )
        for got, whole in outputs:
            if (got != want) if whole else (got != want[: len(got)]):
                bad.append({"prompt_len": len(prompt), "max_tokens": m, "got": got, "want": want})
    return bad


async def soak(args: argparse.Namespace, runtime: Path) -> dict:
    pool = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
    chunk = ["--max-prefill-tokens", str(args.max_prefill_tokens)] if args.mix else []
    procs = {
        "decode": start(runtime, "decode", *pool),
        "prefill": start(runtime, "prefill", *pool, *chunk),
    }
    await wait_up(runtime / "decode.sock")
    await wait_up(runtime / "prefill.sock", linked=True)
    sock = str(runtime / "prefill.sock")
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(256) for _ in range(n)] for n in PREFIX_LENS]
    sem = asyncio.Semaphore(args.concurrency)
    done = errors = tokens = 0
    ends = dict.fromkeys(("whole", "abort", "close"), 0)
    outputs: dict[tuple, list[tuple[list[int], bool]]] = {}
    rows: list[dict] = []
    t0 = time.monotonic()
    shared = client.Connection(sock)

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
        prompt, m, how = draw(rng, args.mix, args.max_tokens, prefixes)
        async with sem:
            try:
                if args.mix:
                    got, whole = await run_one(shared, sock, prompt, m, how)
                    outputs.setdefault((tuple(prompt), m), []).append((got, whole))
                    ends[how] += 1
                else:
                    params = SamplingParams(max_tokens=m, ignore_eos=True)
                    res = await client.generate(
                        sock, prompt_tokens=prompt, sampling=params, timeout=60
                    )
                    got = res.tokens
                tokens += len(got)
            except Exception as exc:
                errors += 1
                print(f"request {i} failed: {exc!r}", file=sys.stderr)
        done += 1
        if done % args.every == 0:
            row()

    row()
    await asyncio.gather(*(one(i) for i in range(args.requests)))
    elapsed = time.monotonic() - t0
    shared.close()
    at_end = await settled(runtime, list(procs))
    cache = (await client.status(sock)).prefix_cache
    codes = {}
    for role in ("prefill", "decode"):  # prefill first: it must not see its link drop mid-stop
        procs[role].send_signal(signal.SIGTERM)
        try:
            codes[role] = procs[role].wait(timeout=60)
        except subprocess.TimeoutExpired:
            procs[role].kill()
            codes[role] = f"hung after SIGTERM (killed), rc {procs[role].wait()}"
    pools = {r: v["pool"] for r, v in at_end.items()}
    all_free = all(pl["free"] == pl["total"] for pl in pools.values())
    held = {r: v["pool"]["owned"] + v["pool"]["leased"] + v["inflight"] for r, v in at_end.items()}
    mismatches = check_tokens(outputs) if args.mix else []
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "mix": args.mix,
        "errors": errors,
        "tokens": tokens,
        "elapsed_s": round(elapsed, 1),
        "req_per_s": round(args.requests / elapsed, 1),
        "tok_per_s": round(tokens / elapsed, 1),
        "samples": rows,
        "pools_at_end": pools,
        "all_free": all_free,
        "held_at_end": held,
        "ends": ends,
        "prefix_cache": cache,
        "checked": sum(len(v) for v in outputs.values()),
        "mismatches": mismatches[:20],
        "mismatch_count": len(mismatches),
        "exit_codes": codes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--every", type=int, default=1000, help="sample RSS/fds every K requests")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", action="store_true", help="shared prefixes, long prompts, aborts")
    ap.add_argument("--num-blocks", type=int, default=0, help="both pools' size (0: default)")
    ap.add_argument("--max-prefill-tokens", type=int, default=256, help="--mix: the chunk size")
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
    print(f"pools at end: {result['pools_at_end']}  exit codes: {result['exit_codes']}")
    if result["mix"]:
        print(
            f"ends: {result['ends']}  prefix cache: {result['prefix_cache']}  "
            f"tokens checked against the reference: {result['checked']} requests, "
            f"{result['mismatch_count']} mismatches"
        )
    ok = result["all_free"] and not any(result["held_at_end"].values())
    ok = ok and not result["errors"] and not result["mismatch_count"]
    ok = ok and set(result["exit_codes"].values()) == {0}
    print(f"{'clean' if ok else 'NOT CLEAN'} -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
