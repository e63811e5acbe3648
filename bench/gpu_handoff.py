"""Handoff latency across two processes: prefill event record -> decode KV usable.

Two ways side by side in one run:
- `pool`: K and V pools exported and opened once per link, an event ring opened once; per request
  only record (prefill) and stream wait + sync (decode);
- `naive`: per request the prefill exports K and V handles and the decode opens them
  (cudaIpcOpenMemHandle x2), waits, and closes them after use (the close is not in the latency).
Latency = decode's perf_counter_ns after its stream is synchronized past the wait, minus the
prefill's perf_counter_ns just before the record (CLOCK_MONOTONIC is shared by both processes); it
includes one pipe message. Usage: python bench/gpu_handoff.py --out handoff.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import time

import msgspec
import torch

from common.ipc.base import RegionDescriptor, backend_for
from common.ipc.events import EventRing, imported_event_ring

POOL_SHAPE = (1024, 16, 32, 8, 128)  # K or V: 1024 blocks of 16 tokens, bf16 = 2 GiB each
TIMEOUT = 60


class Handoff(msgspec.Struct):
    request: int
    slot: int
    t0_ns: int
    regions: list[RegionDescriptor] = []


def prefill(conn, modes: list[str], iters: int) -> None:  # child process
    faulthandler.enable()
    k = torch.zeros(POOL_SHAPE, dtype=torch.bfloat16, device="cuda:0")
    v = torch.zeros(POOL_SHAPE, dtype=torch.bfloat16, device="cuda:0")
    # The naive way's K and V: other allocations, so the link's open mapping is not reused.
    naive_kv = [torch.zeros(POOL_SHAPE, dtype=torch.bfloat16, device="cuda:0") for _ in range(2)]
    ring = EventRing.create(8, 0)
    pool = [backend_for("cuda-raw").export(t) for t in (k, v)]
    torch.cuda.synchronize()
    conn.send_bytes(msgspec.msgpack.encode([[r.desc for r in pool], ring.handles()]))
    stream = torch.cuda.Stream(0)
    for mode in modes:
        for i in range(iters):
            slot = int(conn.recv_bytes())  # "go": the previous request's slot is acked
            if slot >= 0:
                ring.release(slot)
            with torch.cuda.stream(stream):
                k[i % POOL_SHAPE[0], 0].fill_(float(i))
            t0 = time.perf_counter_ns()
            regions = []
            if mode == "naive":
                regions = [backend_for("cuda-raw").export(t).desc for t in naive_kv]
            slot = ring.acquire()
            ring.record(slot, stream)
            conn.send_bytes(msgspec.msgpack.encode(Handoff(i, slot, t0, regions)))
        ring.release(int(conn.recv_bytes()))
    conn.recv_bytes()
    ring.close()


def decode(conn, mode: str, iters: int, ring, stream) -> list[float]:
    lat = []
    conn.send_bytes(b"-1")
    for _ in range(iters):
        msg = msgspec.msgpack.decode(conn.recv_bytes(), type=Handoff)
        opened = [backend_for(d.kind).open(d, []) for d in msg.regions]
        kv = [r.to_tensor() for r in opened]
        ring.wait(msg.slot, stream)
        stream.synchronize()
        lat.append((time.perf_counter_ns() - msg.t0_ns) / 1e3)
        del kv
        for r in opened:
            r.close()
        conn.send_bytes(str(msg.slot).encode())
    return lat


def _stats(lat: list[float], warmup: int) -> dict[str, float]:
    s = sorted(lat[warmup:])
    return {"p50_us": s[len(s) // 2], "p99_us": s[int(len(s) * 0.99)], "n": len(s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()
    faulthandler.enable()
    modes = ["pool", "naive"]
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=prefill, args=(child_end, modes, args.iters), daemon=True)
    child.start()
    if not parent.poll(TIMEOUT):
        raise SystemExit("prefill child did not register in time")
    descs, handles = msgspec.msgpack.decode(
        parent.recv_bytes(), type=tuple[list[RegionDescriptor], list[bytes]]
    )
    pool = [backend_for(d.kind).open(d, []) for d in descs]  # once per link
    ring = imported_event_ring(handles, 0)
    stream = torch.cuda.Stream(0)
    report: dict[str, object] = {"device": torch.cuda.get_device_name(0)}
    for mode in modes:
        report[mode] = _stats(decode(parent, mode, args.iters, ring, stream), args.warmup)
    parent.send_bytes(b"done")
    child.join(timeout=TIMEOUT)
    speedup = report["naive"]["p50_us"] / report["pool"]["p50_us"]
    report["naive_over_pool_p50"] = speedup
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"{'mode':<6} {'p50 us':>8} {'p99 us':>8}")
    for mode in modes:
        print(f"{mode:<6} {report[mode]['p50_us']:>8.1f} {report[mode]['p99_us']:>8.1f}")
    print(f"naive/pool p50: {speedup:.1f}x")
    ring.close()
    for r in pool:
        r.close()


if __name__ == "__main__":
    main()
