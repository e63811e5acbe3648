"""Handoff of one request's KV between two processes: NIXL push, NIXL pull and (on CUDA) the
CUDA-IPC pull, through pdkv's own transfer sides (NixlProducer/NixlConsumer, KVProducer/
KVConsumer), timed as the decode sees a handoff: from the HANDOFF's arrival (the pull posted or
the PUSH sent) to its `done`.

Pools of TinyLlama-1.1B's KV layout (22 layers, 4 KV heads, head_dim 64, block 16, bf16 unless
--dtype) and a request of --tokens tokens (2048 = 128 blocks ≈ 46 MB). Two block patterns: "contiguous" (one run) and
"scattered" (every other block: one run per block). The prefill process is a child; PUSH frames
travel to it over a pipe, as they would over the link. On CPU (DRAM) UCX moves the bytes over
TCP/shared memory (UCX_TLS, default tcp,self,sm); on CUDA over whatever UCX finds (NVLink/IPC).

Usage: python bench/nixl_handoff.py --device cpu --tokens 512 --out nixl.json
       python bench/nixl_handoff.py --device cuda:0 --out nixl.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from multiprocessing.connection import Connection

import torch

from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.protocol import Push, Register, Registered, decode, encode
from common.transfer import KVConsumer, KVProducer
from common.transfer.nixl_agent import NixlAgent
from common.transfer.nixl_sides import NixlConsumer, NixlProducer


def layout(args: argparse.Namespace) -> PoolLayout:
    blocks = -(-args.tokens // 16)
    return PoolLayout(
        num_blocks=2 * blocks + 2,
        num_layers=22,
        num_kv_heads=4,
        head_dim=64,
        block_size=16,
        dtype=args.dtype,
    )


# ---- the prefill process -------------------------------------------------------------------------
def prefill_main(conn: Connection, args: argparse.Namespace, mode: str) -> None:
    asyncio.run(_prefill(conn, args, mode))


async def _prefill(conn: Connection, args: argparse.Namespace, mode: str) -> None:
    loop = asyncio.get_running_loop()
    lay = layout(args)
    if args.device != "cpu":
        torch.cuda.set_device(args.device)
    pool = KVPool.create(lay, args.device)
    pool.tensor.copy_(torch.randn(lay.shape).to(pool.tensor.dtype))
    alloc = BlockAllocator(lay.num_blocks)
    alloc.allocate("bench", lay.num_blocks)  # every block handed to the one link: PUSH may name it
    alloc.lease("bench", "bench-link")
    if mode == "ipc":
        producer: KVProducer = KVProducer(pool, alloc, None, event_slots=4)  # type: ignore[arg-type]
    else:
        producer = NixlProducer(pool, alloc, transfer=mode, loop=loop)
    conn.send(encode(producer.register()[0]))
    try:
        while True:
            cmd, arg = await loop.run_in_executor(None, conn.recv)
            if cmd == "stop":
                return
            if cmd == "registered":
                assert isinstance(producer, NixlProducer)
                producer.connected(decode(arg), "bench-link")  # type: ignore[arg-type]
                conn.send("ok")
            elif cmd == "push":
                assert isinstance(producer, NixlProducer)
                producer.push(
                    decode(arg),  # type: ignore[arg-type]
                    lambda m: conn.send(("failed", m.message)),  # type: ignore[attr-defined]
                    "bench-link",
                )
    finally:
        producer.close()


# ---- the decode process (this one) ---------------------------------------------------------------
async def run_mode(args: argparse.Namespace, mode: str) -> dict[str, dict[str, float]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(child, args, mode), daemon=True)
    proc.start()
    loop = asyncio.get_running_loop()
    lay = layout(args)
    local = KVPool.create(lay, args.device)
    agent = None
    try:
        reg = decode(await loop.run_in_executor(None, parent.recv))
        assert isinstance(reg, Register)
        if mode == "ipc":
            stream = torch.cuda.Stream(args.device)
            consumer = KVConsumer.open(reg, lambda n: [], local, stream)
        else:
            agent = NixlAgent("decode", local.tensor, loop)

            def post(msg: Push) -> None:
                parent.send(("push", encode(msg)))

            consumer = NixlConsumer.open(reg, local, agent, post)  # type: ignore[arg-type]
            ok = Registered(num_blocks=lay.num_blocks, nixl=agent.region(mode))
            parent.send(("registered", encode(ok)))
            await loop.run_in_executor(None, parent.recv)
        out = {}
        for pattern in ("contiguous", "scattered"):
            out[pattern] = await _time(consumer, args, lay, pattern)
        await consumer.drain()
        consumer.close()
        return out
    finally:
        parent.send(("stop", None))
        proc.join(30)
        if agent is not None:
            agent.close()


async def _time(consumer, args, lay: PoolLayout, pattern: str) -> dict[str, float]:  # type: ignore[no-untyped-def]
    n = -(-args.tokens // 16)
    step = 1 if pattern == "contiguous" else 2
    src = list(range(0, n * step, step))
    dst = list(range(lay.num_blocks - n * step, lay.num_blocks, step))
    loop = asyncio.get_running_loop()
    times = []
    for i in range(args.warmup + args.iters):
        fut = loop.create_future()
        t0 = time.perf_counter()
        consumer.pull(src, dst, -1, fut.set_result)
        err = await fut
        dt = time.perf_counter() - t0
        if err is not None:
            raise RuntimeError(f"transfer failed: {err}")
        if i >= args.warmup:
            times.append(dt)
    med = statistics.median(times)
    nbytes = n * lay.block_nbytes
    return {
        "median_us": round(med * 1e6, 1),
        "min_us": round(min(times) * 1e6, 1),
        "gb_per_s": round(nbytes / med / 1e9, 2),
        "bytes": nbytes,
        "runs": 1 if step == 1 else n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dtype", default=None, help="default bfloat16 (the 1.1B's), on every device")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default="push,pull,ipc")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.dtype = args.dtype or "bfloat16"
    modes = [m for m in args.modes.split(",") if m != "ipc" or args.device != "cpu"]
    results = {m: asyncio.run(run_mode(args, m)) for m in modes}
    lay = layout(args)
    print(
        f"{args.tokens} tokens, {-(-args.tokens // 16) * lay.block_nbytes / 1e6:.1f} MB, "
        f"{args.device}, UCX_TLS={os.environ.get('UCX_TLS', '(NIXL default)')}"
    )
    print(f"{'path':<10}{'blocks':<12}{'median µs':>12}{'min µs':>10}{'GB/s':>8}")
    for mode, pats in results.items():
        for pat, r in pats.items():
            print(f"{mode:<10}{pat:<12}{r['median_us']:>12}{r['min_us']:>10}{r['gb_per_s']:>8}")
    if args.out:
        meta = {
            "device": args.device,
            "gpu": torch.cuda.get_device_name(args.device) if args.device != "cpu" else "",
            "host": platform.node(),
            "tokens": args.tokens,
            "dtype": args.dtype,
            "ucx_tls": os.environ.get("UCX_TLS", ""),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
