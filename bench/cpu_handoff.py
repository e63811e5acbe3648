"""CPU handoff latency: HANDOFF sent → the decode holds the KV in its pool → RELEASE received.

A real decode daemon process (shm backend) and, in this process, a minimal prefill side that does
the link handshake once (HELLO, REGISTER with the pool's memfd) and then sends HANDOFFs for
prompts of `--prompt-tokens` tokens with 1, 16 and 256 in flight, timing each until its RELEASE
arrives. max_tokens=1 so the decode finishes each request right after the pull and the figures
measure the handoff alone. Prints a table; --out writes JSON.

    .venv/bin/python bench/cpu_handoff.py [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import client
from common.daemon import lifecycle
from common.ipc.shm import ShmRegion
from common.kv.pool import KVPool, PoolLayout
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from common.protocol import (
    Finish,
    Handoff,
    Hello,
    HelloOk,
    Message,
    Ping,
    Pong,
    Register,
    Registered,
    Release,
    fingerprint,
)
from common.protocol.version import PROTOCOL_VERSION
from common.wire.channel import connect


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def run(args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    model, _ = load_model(None)
    layers, heads, dim = model.kv_layout_args()
    bs = 16
    layout = PoolLayout(
        num_blocks=args.blocks,
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=dim,
        block_size=bs,
        dtype="float32",
    )
    pool = KVPool.create(layout)
    pool.tensor.normal_()
    region = ShmRegion.export(pool.tensor)
    fp = fingerprint(model_id=model.fingerprint, layout=layout.to_wire(), backend="shm")

    rt = Path(tempfile.mkdtemp(prefix="pdkv-bench-"))
    log = open(rt / "decode.log", "wb")  # noqa: SIM115
    decode = (
        None
        if args.decode_socket
        else subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdkv.cli",
                "--runtime-dir",
                str(rt),
                "--log-format",
                "json",
                "--log-level",
                "WARNING",
                "decode",
                "start",
                "--device",
                "cpu",
                "--num-blocks",
                str(args.blocks),
                "--spin-us",
                str(args.spin_us),
            ],
            stdout=log,
            stderr=log,
        )
    )
    sock = str(args.decode_socket or rt / "decode.sock")
    try:
        for _ in range(600):
            try:
                await client.status(sock, timeout=1)
                break
            except (OSError, TimeoutError):
                await asyncio.sleep(0.05)
        ch = await connect(sock)
        await ch.send(
            Hello(
                protocol_version=PROTOCOL_VERSION,
                fingerprint=fp,
                backend="shm",
                pid=os.getpid(),
                name="bench",
            )
        )
        assert isinstance(await ch.recv(), HelloOk)
        await ch.send(Register.build(layout.to_wire(), [region.desc], [1], []), region.fds())
        assert isinstance(await ch.recv(), Registered)

        released: dict[str, int] = {}
        pulls: list[float] = []  # decode side: HANDOFF read → KV in its pool
        arrivals: list[float] = []  # HANDOFF sent → the decode starts on it
        waiters: dict[str, asyncio.Future[None]] = {}

        def on_frame(msg: Message) -> None:
            if isinstance(msg, Release):
                released[msg.request_id] = time.monotonic_ns()
                fut = waiters.pop(msg.request_id, None)
                if fut is not None:
                    fut.set_result(None)
            elif isinstance(msg, Finish):
                pulls.append(msg.timings.get("pull_us", 0.0))
                arrivals.append(
                    msg.timings.get("decode_handoff_us", 0.0) - msg.timings.get("pull_us", 0.0)
                )
            elif isinstance(msg, Pong):
                released[f"ping{msg.seq}"] = time.monotonic_ns()
                fut = waiters.pop(f"ping{msg.seq}", None)
                if fut is not None:
                    fut.set_result(None)

        rtask = asyncio.create_task(ch.dispatch(on_frame))
        nblk = -(-args.prompt_tokens // bs)
        prompt = list(range(1, args.prompt_tokens + 1))
        params = SamplingParams(max_tokens=1)
        loop = asyncio.get_running_loop()
        seq = 0
        results = {}
        for inflight, rounds in (
            (1, args.rounds),
            (16, max(20, args.rounds // 16)),
            (256, max(5, args.rounds // 128)),
        ):
            lat: list[float] = []
            for r in range(rounds + 2):  # two warm-up rounds
                sent: dict[str, int] = {}
                futs = []
                for i in range(inflight):
                    rid = f"b{seq}"
                    seq += 1
                    ids = [((i * nblk) + j) % args.blocks for j in range(nblk)]
                    fut = loop.create_future()
                    waiters[rid] = fut
                    futs.append(fut)
                    sent[rid] = time.monotonic_ns()
                    await ch.send(
                        Handoff(
                            request_id=rid,
                            block_ids=ids,
                            num_tokens=len(prompt),
                            prompt_tokens=prompt,
                            first_token=1,
                            sampling=params,
                            sent_ns=sent[rid],
                        )
                    )
                    ch.spin(args.spin_us / 1e6)  # as the prefill daemon's link does
                await asyncio.wait_for(asyncio.gather(*futs), 30)
                if r >= 2:
                    lat += [(released[k] - v) / 1000 for k, v in sent.items()]
            results[inflight] = {
                "n": len(lat),
                "p50_us": pct(lat, 0.5),
                "p99_us": pct(lat, 0.99),
                "mean_us": statistics.fmean(lat),
                "decode_pull_p50_us": pct(pulls, 0.5) if pulls else 0.0,
                "arrival_p50_us": pct(arrivals, 0.5) if arrivals else 0.0,
            }
            pulls.clear()
            arrivals.clear()
        # the floor: a PING → PONG round trip over the same link (no handoff work at all)
        rtts: list[float] = []
        for i in range(args.rounds + 2):
            fut = loop.create_future()
            waiters[f"ping{i}"] = fut
            t0 = time.monotonic_ns()
            await ch.send(Ping(seq=i, sent_ns=t0))
            ch.spin(args.spin_us / 1e6)
            await asyncio.wait_for(fut, 30)
            if i >= 2:
                rtts.append((released[f"ping{i}"] - t0) / 1000)
        results["ping"] = {
            "n": len(rtts),
            "p50_us": pct(rtts, 0.5),
            "p99_us": pct(rtts, 0.99),
            "mean_us": statistics.fmean(rtts),
            "decode_pull_p50_us": 0.0,
            "arrival_p50_us": 0.0,
        }
        rtask.cancel()
        ch.close()
        st = await client.status(sock)
        assert st.pool["free"] == st.pool["total"], f"decode leaked blocks: {st.pool}"
    finally:
        if decode is not None:
            decode.terminate()
            decode.wait(timeout=30)
    return {
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "date": time.strftime("%Y-%m-%d"),
        "prompt_tokens": args.prompt_tokens,
        "block_nbytes": layout.block_nbytes,
        "results": results,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2000, help="handoffs at 1 in flight")
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--spin-us",
        type=int,
        default=0,
        help="the daemons' --spin-us, on both sides (0: sleep in epoll between frames)",
    )
    ap.add_argument(
        "--decode-socket",
        type=Path,
        help="use a decode daemon already running there (e.g. under a profiler) instead of "
        "starting one; it needs --num-blocks >= --blocks",
    )
    args = ap.parse_args()
    sys.setswitchinterval(0.0002)  # as the daemons do
    res = lifecycle.run(lambda: run(args))  # uvloop, as the daemons use
    print(
        f"CPU handoff ({res['prompt_tokens']}-token prompt, {res['block_nbytes']} B blocks), {res['machine']}, {res['date']}"
    )
    print(
        f"{'in flight':>9} {'n':>6} {'p50 us':>8} {'p99 us':>8} {'mean us':>8} {'decode-side p50':>15}"
        f" {'arrival p50':>11}"
    )
    for k, v in res["results"].items():
        print(
            f"{k:>9} {v['n']:>6} {v['p50_us']:>8.1f} {v['p99_us']:>8.1f} {v['mean_us']:>8.1f} "
            f"{v['decode_pull_p50_us']:>15.1f} {v['arrival_p50_us']:>11.1f}"
        )
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
