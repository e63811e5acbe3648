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

from common.ipc.backends import backend_for
from common.ipc.base import RegionDescriptor
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
            if mode.startswith("naive"):
                regions = [backend_for("cuda-raw").export(t).desc for t in naive_kv]
            slot = ring.acquire()
            ring.record(slot, stream)
            conn.send_bytes(msgspec.msgpack.encode(Handoff(i, slot, t0, regions)))
        ring.release(int(conn.recv_bytes()))
    conn.recv_bytes()
    ring.close()


def decode(
    conn, mode: str, iters: int, ring, stream, spin: bool, device: torch.device
) -> dict[str, list[float]]:
    """Per request: total latency, message transit, open+wait call, GPU sync (all in us).

    `usable` ends when the decode's stream is ordered after the prefill's writes (the wait call
    returned): work queued on it from then on sees the KV. `total` ends when the host has seen it.
    """
    parts: dict[str, list[float]] = {
        "total": [],
        "usable": [],
        "message": [],
        "open_wait": [],
        "sync": [],
    }
    conn.send_bytes(b"-1")
    for _ in range(iters):
        while spin and not conn.poll(0):
            pass
        raw = conn.recv_bytes()
        t_msg = time.perf_counter_ns()
        msg = msgspec.msgpack.decode(raw, type=Handoff)
        opened = [backend_for(d.kind).open_for(d, [], device) for d in msg.regions]
        kv = [r.to_tensor() for r in opened]
        ring.wait(msg.slot, stream)
        t_wait = time.perf_counter_ns()
        stream.synchronize()
        t1 = time.perf_counter_ns()
        for key, a, b in (
            ("total", msg.t0_ns, t1),
            ("usable", msg.t0_ns, t_wait),
            ("message", msg.t0_ns, t_msg),
            ("open_wait", t_msg, t_wait),
            ("sync", t_wait, t1),
        ):
            parts[key].append((b - a) / 1e3)
        del kv
        for r in opened:
            r.close()
        conn.send_bytes(str(msg.slot).encode())
    return parts


def _stats(parts: dict[str, list[float]], warmup: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, lat in parts.items():
        s = sorted(lat[warmup:])
        name = "" if key == "total" else f"{key}_"
        out[f"{name}p50_us"] = s[len(s) // 2]
        out[f"{name}p99_us"] = s[int(len(s) * 0.99)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument(
        "--decode-device", type=int, default=0, help="decode's GPU (the prefill is on GPU 0)"
    )
    args = parser.parse_args()
    device = torch.device("cuda", args.decode_device)
    torch.cuda.set_device(device)
    faulthandler.enable()
    # blocking receive, then spin-polling receive (a busy decode loop polls; a sleeping process
    # pays the wake-up of an idle vCPU, which in a microVM can dominate)
    modes = ["pool", "naive", "pool_spin", "naive_spin"]
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=prefill, args=(child_end, modes, args.iters), daemon=True)
    child.start()
    if not parent.poll(TIMEOUT):
        raise SystemExit("prefill child did not register in time")
    descs, handles = msgspec.msgpack.decode(
        parent.recv_bytes(), type=tuple[list[RegionDescriptor], list[bytes]]
    )
    pool = [backend_for(d.kind).open_for(d, [], device) for d in descs]  # once per link
    ring = imported_event_ring(handles, device)
    stream = torch.cuda.Stream(device)
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name(0),
        "prefill_device": 0,
        "decode_device": args.decode_device,
    }
    for mode in modes:
        parts = decode(
            parent, mode, args.iters, ring, stream, spin=mode.endswith("_spin"), device=device
        )
        report[mode] = _stats(parts, args.warmup)
    parent.send_bytes(b"done")
    child.join(timeout=TIMEOUT)
    for suffix in ("", "_spin"):
        ratio = report[f"naive{suffix}"]["p50_us"] / report[f"pool{suffix}"]["p50_us"]
        report[f"naive_over_pool_p50{suffix}"] = ratio
        usable = (
            report[f"naive{suffix}"]["usable_p50_us"] / report[f"pool{suffix}"]["usable_p50_us"]
        )
        report[f"naive_over_pool_usable_p50{suffix}"] = usable
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"prefill cuda:0 -> decode cuda:{args.decode_device}")
    cols = (
        "p50_us",
        "p99_us",
        "usable_p50_us",
        "usable_p99_us",
        "message_p50_us",
        "open_wait_p50_us",
        "sync_p50_us",
    )
    print(f"{'mode':<11}" + "".join(f"{c:>17}" for c in cols))
    for mode in modes:
        print(f"{mode:<11}" + "".join(f"{report[mode][c]:>17.1f}" for c in cols))
    print(
        f"naive/pool p50: {report['naive_over_pool_p50']:.1f}x blocking, "
        f"{report['naive_over_pool_p50_spin']:.1f}x spinning; until usable: "
        f"{report['naive_over_pool_usable_p50']:.1f}x blocking, "
        f"{report['naive_over_pool_usable_p50_spin']:.1f}x spinning"
    )
    ring.close()
    for r in pool:
        r.close()


if __name__ == "__main__":
    main()
