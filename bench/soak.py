"""Soak test: N requests through a real prefill/decode pair on CPU, bounded concurrency.

Every K requests it samples RSS and open fds of both daemons (/proc), prints a table and writes
JSON; at the end both pools must report every block free. Exit 0 when the soak was clean.

`--mix` makes the traffic what leaks blocks if anything does: a third of the prompts start with
one of four shared prefixes (prefix-cache hits, blocks shared by requests in flight together),
one in twenty is long enough to be chunked (the prefill runs at most `--max-prefill-tokens`
positions a forward), one request in four samples (temperature, top-p, a repetition penalty)
with a seed of its own, one in six is aborted by its client after its first token and one in
twelve has its connection closed under it; `--num-blocks` small enough puts the pools under
pressure (waits, evictions), `--decodes N` puts N decode daemons behind the prefill. Afterwards
every request's tokens must be those of the single-process reference (`common.model.reference`,
which reproduces a seeded draw too), a cut-short one's a prefix of them, whatever the cache, the
batch or the aborts around it; and no daemon may hold a block (OWNED or LEASED) or a request.
Prefix-cache blocks may stay CACHED: that is the cache.

    .venv/bin/python bench/soak.py --requests 10000 --concurrency 32 --every 1000 --out soak.json
    .venv/bin/python bench/soak.py --mix --requests 2000 --num-blocks 384 [--decodes 2]
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


async def wait_up(sock: Path, links: int = 0, timeout: float = 120) -> None:
    """Until the daemon answers STATUS, with at least `links` links up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            st = await client.status(str(sock), timeout=1)
            if not links or sum(1 for link in st.links if link.get("state") == "up") >= links:
                return
        except Exception:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit(f"{sock} did not come up in {timeout}s")


def sample(pids: list[int]) -> dict[str, float]:
    """RSS (the largest) and open fds (the most) of the processes."""
    procs = [psutil.Process(pid) for pid in pids]
    return {
        "rss_mib": max(round(p.memory_info().rss / 2**20, 1) for p in procs),
        "fds": max(p.num_fds() for p in procs),
    }


#: --mix: the shared prefixes' lengths (a multiple of the block size and not) and how a request
#: ends: run to its FINISH, aborted by its client after its first tokens, its connection closed
PREFIX_LENS = (16, 40, 64, 150)
HOWS = ("whole",) * 9 + ("abort", "abort", "close")


def draw_params(rng: random.Random, mix: bool, m: int) -> SamplingParams:
    """Greedy; with --mix one request in four samples (temperature, top-p, a repetition
    penalty) with a seed of its own, which gives the same tokens in any process."""
    if not mix or rng.random() >= 0.25:
        return SamplingParams(max_tokens=m, ignore_eos=True)
    return SamplingParams(
        max_tokens=m,
        ignore_eos=True,
        temperature=0.8,
        top_p=0.9,
        repetition_penalty=1.1,
        seed=rng.randrange(2**31),
    )


def draw(
    rng: random.Random, mix: bool, max_tokens: int, prefixes: list[list[int]]
) -> tuple[list[int], SamplingParams, str]:
    """One request: (prompt, params, how it ends)."""
    m = rng.randrange(1, max_tokens + 1)
    if not mix:
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 80))]
        return prompt, draw_params(rng, mix, m), "whole"
    roll = rng.random()
    if roll < 1 / 3:  # a shared prefix, then 0-40 tokens of its own (0: the whole prompt cached)
        own = [rng.randrange(256) for _ in range(rng.randrange(0, 41))]
        prompt = rng.choice(prefixes) + own
    elif roll < 1 / 3 + 1 / 20:  # long: chunked
        prompt = [rng.randrange(256) for _ in range(rng.randrange(300, 700))]
    else:
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 80))]
    how = rng.choice(HOWS)
    return prompt, draw_params(rng, mix, m if how == "whole" else max(m, 2)), how


async def run_one(
    conn: client.Connection, sock: str, prompt: list[int], params: SamplingParams, how: str
) -> tuple[list[int], bool]:
    """(the tokens received, whether the request ran to its FINISH)."""
    own = client.Connection(sock) if how == "close" else conn
    got: list[int] = []
    stream = own.stream(prompt_tokens=prompt, sampling=params, timeout=60, text_deltas=False)
    async with contextlib.aclosing(stream) as frames:
        async for msg in frames:
            if not isinstance(msg, Tokens):
                return got, True  # its FINISH
            got.extend(msg.tokens)
            if got and how == "abort":
                return got, False  # aclosing sends ABORT
            if got and how == "close":
                own.close()  # the daemon aborts everything the connection had
                return got, False
    return got, False


async def settled(socks: dict[str, Path], timeout: float = 10.0) -> dict:
    """Each daemon's STATUS once none holds a block (OWNED or LEASED) or a request, or at the
    timeout as they are then."""
    deadline = time.monotonic() + timeout
    while True:
        replies = {role: await client.status(str(sock)) for role, sock in socks.items()}
        clean = all(
            st.pool["owned"] == 0 and st.pool["leased"] == 0 and st.inflight == 0
            for st in replies.values()
        )
        if clean or time.monotonic() > deadline:
            return {r: {"pool": st.pool, "inflight": st.inflight} for r, st in replies.items()}
        await asyncio.sleep(0.1)


def check_tokens(outputs: dict[tuple, list[tuple[list[int], bool]]]) -> list[dict]:
    """Every request's tokens against the single-process reference (greedy, or sampled with its
    seed): the whole output for one that finished, a prefix of it for one cut short. The
    mismatches."""
    import torch

    from common.model import load_model, reference

    torch.set_num_threads(1)
    model, _ = load_model(None)
    bad = []
    for (prompt, params), runs in outputs.items():
        want = reference.generate(model, list(prompt), params)
        for got, whole in runs:
            if (got != want) if whole else (got != want[: len(got)]):
                bad.append({"prompt_len": len(prompt), "params": repr(params), "got": got})
    return bad


def start_daemons(args: argparse.Namespace, runtime: Path) -> tuple[dict, dict[str, Path]]:
    """--decodes decode daemons (the first in `runtime`, the others in runtime/dN) and the
    prefill linked to all of them: (role -> process, role -> STATUS socket)."""
    pool = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
    chunk = ["--max-prefill-tokens", str(args.max_prefill_tokens)] if args.mix else []
    dirs = {"decode": runtime} | {f"decode{i}": runtime / f"d{i}" for i in range(1, args.decodes)}
    for d in list(dirs.values())[1:]:
        d.mkdir(mode=0o700)
    links = [] if args.decodes == 1 else [f"--decode={d / 'decode.sock'}" for d in dirs.values()]
    procs = {"prefill": start(runtime, "prefill", *pool, *chunk, *links)}
    procs |= {role: start(d, "decode", *pool) for role, d in dirs.items()}
    socks = {role: d / "decode.sock" for role, d in dirs.items()}
    return procs, {"prefill": runtime / "prefill.sock", **socks}


async def soak(args: argparse.Namespace, runtime: Path) -> dict:
    procs, socks = start_daemons(args, runtime)
    for role, path in socks.items():
        await wait_up(path, links=args.decodes if role == "prefill" else 0)
    sock = str(socks["prefill"])
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(256) for _ in range(n)] for n in PREFIX_LENS]
    sem = asyncio.Semaphore(args.concurrency)
    done = errors = tokens = 0
    ends = dict.fromkeys(("whole", "abort", "close"), 0)
    outputs: dict[tuple, list[tuple[list[int], bool]]] = {}  # (prompt, params) -> its runs
    rows: list[dict] = []
    t0 = time.monotonic()
    shared = client.Connection(sock)

    def row() -> None:
        p = sample([procs["prefill"].pid])
        d = sample([proc.pid for role, proc in procs.items() if role != "prefill"])
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
        prompt, params, how = draw(rng, args.mix, args.max_tokens, prefixes)
        async with sem:
            try:
                if args.mix:
                    got, whole = await run_one(shared, sock, prompt, params, how)
                    outputs.setdefault((tuple(prompt), params), []).append((got, whole))
                    ends[how] += 1
                else:
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
    at_end = await settled(socks)
    cache = (await client.status(sock)).prefix_cache
    codes = {}
    for role, proc in procs.items():  # the prefill first: it must not see a link drop mid-stop
        proc.send_signal(signal.SIGTERM)
        try:
            codes[role] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[role] = f"hung after SIGTERM (killed), rc {proc.wait()}"
    pools = {r: v["pool"] for r, v in at_end.items()}
    all_free = all(pl["free"] == pl["total"] for pl in pools.values())
    held = {r: v["pool"]["owned"] + v["pool"]["leased"] + v["inflight"] for r, v in at_end.items()}
    mismatches = check_tokens(outputs) if args.mix else []
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "mix": args.mix,
        "decodes": args.decodes,
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
        "sampled": sum(len(v) for (_, params), v in outputs.items() if not params.greedy),
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
    ap.add_argument("--decodes", type=int, default=1, help="decode daemons behind the prefill")
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
    # the decodes' figures: the largest RSS and the most fds of any of them
    for r in ("prefill", "decode"):
        print(
            f"{r:10}{first[r + '_rss_mib']:>15}{last[r + '_rss_mib']:>14}"
            f"{first[r + '_fds']:>11}{last[r + '_fds']:>10}"
        )
    print(f"pools at end: {result['pools_at_end']}  exit codes: {result['exit_codes']}")
    if result["mix"]:
        print(
            f"ends: {result['ends']} ({result['sampled']} sampled with a seed)  "
            f"prefix cache: {result['prefix_cache']}  "
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
