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
batch or the aborts around it (a greedy token may differ only at a numerical tie of the
reference's logits, and the rest must then follow the reference from that token: counted as
`ties`, `common.model.reference.compare`); and no daemon may hold a block (OWNED or LEASED) or
a request.
Prefix-cache blocks may stay CACHED: that is the cache. A request that does not match is
reported with its request id (`soak-SEED-N`, as the daemons' logs name it), and the daemons'
logs are kept beside the JSON (`OUT.logs/`).

`--kill ROLE --kill-every S` (with `--mix`) adds faults: every S seconds one daemon of that role
(`decode`: each decode in turn; `prefill`) is killed with SIGKILL and started again in its
runtime dir. A request in flight on it may end in LINK_LOST or a lost connection (counted as
`lost`, its tokens so far checked as a prefix of the reference); new requests wait while the
prefill is down. Afterwards, besides the checks above, no daemon may map more shared memory
than it did at the start: a decode that kept a dead prefill's pool mapped, or a prefill a dead
decode's, fails.

    .venv/bin/python bench/soak.py --requests 10000 --concurrency 32 --every 1000 --out soak.json
    .venv/bin/python bench/soak.py --mix --requests 2000 --num-blocks 384 [--decodes 2]
    .venv/bin/python bench/soak.py --mix --requests 4000 --decodes 2 --kill decode --kill-every 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from common import client
from common.model.sampling import SamplingParams
from common.protocol import ConnectionClosed, ErrorCode, Tokens

if TYPE_CHECKING:
    from common.model import LlamaModel

ROOT = Path(__file__).resolve().parent.parent


def start(runtime: Path, role: str, *args: str, level: str = "WARNING") -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "pdkv.cli",
        "--runtime-dir",
        str(runtime),
        "--log-format",
        "json",
        "--log-level",
        level,
        role,
        "start",
        "--device",
        "cpu",
        *args,
    ]
    with open(runtime / f"{role}.log", "ab") as log:  # the daemon writes to its own copy
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
    tails = [
        f"--- {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        for log in sorted(sock.parent.glob("**/*.log"))
    ]
    raise SystemExit("\n".join([f"{sock} did not come up in {timeout}s", *tails]))


def shm_mib(pid: int) -> float:
    """MiB of memfd-backed shared memory process `pid` maps (its pool, the pools it imports)."""
    total = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/memfd:"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            total += hi - lo
    return round(total / 2**20, 2)


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


@dataclass
class Run:
    """One request as its client saw it: its tokens, whether it ran to its FINISH, and for a
    mismatch's report its number, when it ended (s from the start) and its decode."""

    got: list[int] = field(default_factory=list)
    whole: bool = False
    request_id: str = ""  # as the daemons' logs name it
    i: int = -1
    end_s: float = 0.0
    decode: str = ""


class Lost(Exception):
    """A request cut by a daemon's death (--kill): LINK_LOST, or the prefill's connection lost."""

    def __init__(self, got: list[int], why: BaseException) -> None:
        super().__init__(repr(why))
        self.got = got


async def run_one(
    conn: client.Connection,
    sock: str,
    prompt: list[int],
    params: SamplingParams,
    how: str,
    *,
    request_id: str,
    faults: bool = False,
) -> Run:
    """The request's Run. With `faults`, a request a daemon's death cut raises Lost with its
    tokens so far."""
    own = client.Connection(sock) if how == "close" else conn
    run = Run(request_id=request_id)
    got = run.got
    stream = own.stream(
        prompt_tokens=prompt,
        sampling=params,
        timeout=60,
        text_deltas=False,
        request_id=request_id,
    )
    try:
        async with contextlib.aclosing(stream) as frames:
            async for msg in frames:
                if not isinstance(msg, Tokens):
                    run.whole, run.decode = True, msg.decode  # its FINISH
                    return run
                got.extend(msg.tokens)
                if got and how == "abort":
                    return run  # aclosing sends ABORT
                if got and how == "close":
                    own.close()  # the daemon aborts everything the connection had
                    return run
    except client.RequestFailed as exc:
        if faults and exc.code == ErrorCode.LINK_LOST:
            raise Lost(got, exc) from exc
        raise
    except (OSError, ConnectionClosed) as exc:  # the prefill died under it
        if faults:
            raise Lost(got, exc) from exc
        raise
    finally:
        if own is not conn:  # its own connection, however the request ended
            own.close()
    return run


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


def check_tokens(outputs: dict[tuple, list[Run]]) -> tuple[list[dict], list[dict]]:
    """Every request's tokens against the single-process reference (greedy, or sampled with its
    seed): the whole output for one that finished, a prefix of it for one cut short, where a
    greedy one may part from it only at a numerical tie (`reference.compare`). The mismatches,
    and the ties."""
    import torch

    from common.model import load_model

    before = torch.get_num_threads()  # the soak may run inside a test session: put it back
    torch.set_num_threads(1)
    try:
        return _check_tokens(load_model(None)[0], outputs)
    finally:
        torch.set_num_threads(before)


def _check_tokens(
    model: LlamaModel, outputs: dict[tuple, list[Run]]
) -> tuple[list[dict], list[dict]]:
    from common.model import reference

    bad, ties = [], []
    for (prompt, params), runs in outputs.items():
        want = reference.generate(model, list(prompt), params)
        for run in runs:
            got = run.got
            if got == (want if run.whole else want[: len(got)]):
                continue
            ok, found = reference.compare(model, prompt, params, got, whole=run.whole)
            if ok:
                ties += [{"request_id": run.request_id, **asdict(t)} for t in found]
            else:
                bad.append(
                    {"prompt": list(prompt), "params": repr(params), "want": want, **asdict(run)}
                )
    return bad, ties


Spawn = dict[str, Callable[[], subprocess.Popen]]


def start_daemons(args: argparse.Namespace, runtime: Path) -> tuple[dict, dict[str, Path], Spawn]:
    """--decodes decode daemons (the first in `runtime`, the others in runtime/dN) and the
    prefill linked to all of them: (role -> process, role -> STATUS socket, role -> how to
    start it again)."""
    pool = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
    chunk = ["--max-prefill-tokens", str(args.max_prefill_tokens)] if args.mix else []
    dirs = {"decode": runtime} | {f"decode{i}": runtime / f"d{i}" for i in range(1, args.decodes)}
    for d in list(dirs.values())[1:]:
        d.mkdir(mode=0o700)
    links = [] if args.decodes == 1 else [f"--decode={d / 'decode.sock'}" for d in dirs.values()]
    level = args.log_level
    spawn: Spawn = {
        "prefill": lambda: start(runtime, "prefill", *pool, *chunk, *links, level=level)
    }
    for role, d in dirs.items():
        spawn[role] = lambda d=d: start(d, "decode", *pool, level=level)
    procs = {role: launch() for role, launch in spawn.items()}
    socks = {role: d / "decode.sock" for role, d in dirs.items()}
    return procs, {"prefill": runtime / "prefill.sock", **socks}, spawn


async def chaos(
    args: argparse.Namespace,
    procs: dict[str, subprocess.Popen],
    socks: dict[str, Path],
    spawn: Spawn,
    serving: asyncio.Event,
    kills: list[dict],
    stop: asyncio.Event,
) -> None:
    """Every --kill-every seconds until `stop`, SIGKILL one daemon of --kill's role (decodes in
    turn) and start it again; new requests wait (`serving` cleared) while the prefill is down.
    A kill under way when `stop` is set ends with its daemon up and linked again."""
    victims = ["prefill"] if args.kill == "prefill" else [r for r in procs if r != "prefill"]
    for n in range(10**9):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), args.kill_every)
        if stop.is_set():
            return
        role = victims[n % len(victims)]
        if role == "prefill":
            serving.clear()
        t = time.monotonic()
        procs[role].kill()
        await asyncio.to_thread(procs[role].wait)
        procs[role] = spawn[role]()
        await wait_up(socks["prefill"], links=args.decodes)  # its links again, either way
        serving.set()
        kills.append({"role": role, "at": round(t, 3), "down_s": round(time.monotonic() - t, 2)})
        print(f"killed and restarted {role} ({kills[-1]['down_s']} s)", flush=True)


async def soak(args: argparse.Namespace, runtime: Path) -> dict:
    procs, socks, spawn = start_daemons(args, runtime)
    try:
        return await _soak(args, procs, socks, spawn)
    finally:  # a soak that failed half-way (a daemon that never came up) leaves none running
        for proc in procs.values():  # the ones a kill started again included
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def _soak(
    args: argparse.Namespace,
    procs: dict[str, subprocess.Popen],
    socks: dict[str, Path],
    spawn: Spawn,
) -> dict:
    for role, path in socks.items():
        await wait_up(path, links=args.decodes if role == "prefill" else 0)
    shm_at_start = {role: shm_mib(proc.pid) for role, proc in procs.items()}
    faults = bool(args.kill_every)
    serving = asyncio.Event()
    serving.set()
    kills: list[dict] = []
    lost = 0
    sock = str(socks["prefill"])
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(256) for _ in range(n)] for n in PREFIX_LENS]
    sem = asyncio.Semaphore(args.concurrency)
    done = errors = tokens = 0
    ends = dict.fromkeys(("whole", "abort", "close", "lost"), 0)
    outputs: dict[tuple, list[Run]] = {}  # (prompt, params) -> its runs
    rows: list[dict] = []
    t0 = time.monotonic()
    shared = client.Connection(sock)

    def row() -> None:
        try:
            p = sample([procs["prefill"].pid])
            d = sample([proc.pid for role, proc in procs.items() if role != "prefill"])
        except psutil.NoSuchProcess:  # a daemon killed (--kill) as it was sampled: no row
            return
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
        nonlocal done, errors, tokens, lost
        prompt, params, how = draw(rng, args.mix, args.max_tokens, prefixes)
        async with sem:
            await serving.wait()
            try:
                if args.mix:
                    rid = f"soak-{args.seed}-{i}"
                    try:
                        run = await run_one(
                            shared, sock, prompt, params, how, request_id=rid, faults=faults
                        )
                    except Lost as exc:
                        run, how = Run(exc.got, request_id=rid), "lost"
                        lost += 1
                    run.i, run.end_s = i, round(time.monotonic() - t0, 3)
                    outputs.setdefault((tuple(prompt), params), []).append(run)
                    ends[how] += 1
                    got = run.got
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
    stop = asyncio.Event()
    monkey = (
        asyncio.create_task(chaos(args, procs, socks, spawn, serving, kills, stop))
        if faults
        else None
    )
    await asyncio.gather(*(one(i) for i in range(args.requests)))
    if monkey is not None:
        stop.set()
        await monkey  # a kill under way ends with its daemon up and linked again
    elapsed = time.monotonic() - t0
    shared.close()
    at_end = await settled(socks)
    shm_at_end = {role: shm_mib(proc.pid) for role, proc in procs.items()}
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
    mismatches, ties = check_tokens(outputs) if args.mix else ([], [])
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
        "ties": ties[:20],
        "tie_count": len(ties),
        "exit_codes": codes,
        "kills": kills,
        "t0": round(t0, 3),
        "lost": lost,
        "shm_mib_at_start": shm_at_start,
        "shm_mib_at_end": shm_at_end,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--every", type=int, default=1000, help="sample RSS/fds every K requests")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--log-level",
        default="WARNING",
        help="the daemons' (their logs are kept beside --out when a request does not match)",
    )
    ap.add_argument("--mix", action="store_true", help="shared prefixes, long prompts, aborts")
    ap.add_argument("--num-blocks", type=int, default=0, help="both pools' size (0: default)")
    ap.add_argument("--max-prefill-tokens", type=int, default=256, help="--mix: the chunk size")
    ap.add_argument("--decodes", type=int, default=1, help="decode daemons behind the prefill")
    ap.add_argument(
        "--kill", choices=["decode", "prefill"], default="decode", help="--kill-every's"
    )
    ap.add_argument(
        "--kill-every", type=float, default=0, help="--mix: SIGKILL and restart a daemon this often"
    )
    ap.add_argument("--out", type=Path, default=Path("soak.json"))
    args = ap.parse_args(argv)
    if args.kill_every and not args.mix:
        ap.error("--kill-every needs --mix")
    return args


def run(args: argparse.Namespace) -> dict:
    """The soak in a fresh runtime dir (short: it holds the sockets), its result written to --out
    and its figures printed; the result. Where a request does not match, the daemons' logs are
    kept beside --out (`result["logs"]`)."""
    with tempfile.TemporaryDirectory(prefix="pdkv-soak-") as tmp:
        os.chmod(tmp, 0o700)
        result = asyncio.run(soak(args, Path(tmp)))
        if result["mismatch_count"]:  # the daemons' logs, for the requests named in it
            logs = args.out.with_suffix(".logs")
            for log in Path(tmp).glob("**/*.log"):
                dest = logs / log.relative_to(tmp)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(log, dest)
            result["logs"] = str(logs)
    args.out.write_text(json.dumps(result, indent=2))
    report(result, args)
    return result


def clean(result: dict) -> bool:
    """Every pool all free, no daemon holding a block or a request or mapping more shared memory
    than at its start, no error, no mismatch, every daemon stopped with exit 0."""
    ok = result["all_free"] and not any(result["held_at_end"].values())
    ok = ok and result["shm_mib_at_end"] == result["shm_mib_at_start"]
    ok = ok and not result["errors"] and not result["mismatch_count"]
    return ok and set(result["exit_codes"].values()) == {0}


def report(result: dict, args: argparse.Namespace) -> None:
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
            f"{result['mismatch_count']} mismatches, {result['tie_count']} greedy tokens parted "
            "from it at a numerical tie"
        )
    if result["kills"]:
        print(
            f"kills: {len(result['kills'])} ({args.kill}), requests lost to them: "
            f"{result['lost']}  shared memory mapped, MiB, at start {result['shm_mib_at_start']}"
            f"  at end {result['shm_mib_at_end']}"
        )
    print(f"{'clean' if clean(result) else 'NOT CLEAN'} -> {args.out}")


def main() -> int:
    return 0 if clean(run(parse_args())) else 1


if __name__ == "__main__":
    sys.exit(main())
