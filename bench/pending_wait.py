"""Probe: may a decode queue its pull and step behind a prefill's event *before* the forward ends?

Two processes share one GPU (no MPS: their contexts time-slice). The producer runs a long
"forward" (matmuls, ~`--forward-ms` of GPU time), then a tiny kernel writes a token into a
shared device buffer (the mailbox), then it records an interprocess event. The consumer runs a
"step" (`--step-gemvs` GEMVs at batch 1, about a decode step's weight traffic) that reads the
mailbox, and reports when its host saw the step end. Four modes, alternated trial by trial:

- `after`: the consumer starts its wait and step only once the producer's host has seen the
  forward end (today's KV_READY path, without its sockets);
- `pending`: the producer tells the consumer right after the record (before the forward ends on
  the GPU); the consumer queues `wait_event` + step at once and the GPU runs them when the
  forward ends (the design for the 2nd token: KV_LAUNCHED);
- `poll`: told as for `pending`, the consumer's host polls the event (`cudaEventQuery`) and
  launches once it completed: no GPU-side wait across the two contexts;
- `alone`: the producer's forward with no consumer work at all (does a pending wait slow it?).

Printed per mode: the producer's forward (launch → its host saw it end, ms), and the gap from
the producer's host seeing the forward end to the consumer's host seeing the step end (ms):
medians and p90 over the trials; and the consumer's step alone, with no producer.
One JSON line at the end for docs/benchmarks.md.

    python3 bench/pending_wait.py --trials 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.multiprocessing as mp

MODES = ("after", "pending", "poll", "alone")


def _forward(a: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    x = a
    for _ in range(n):
        x = torch.tanh(x @ w)
    return x


def _producer(ctl: mp.Queue, to_c: mp.Queue, from_c: mp.Queue, args: argparse.Namespace) -> None:
    torch.cuda.set_device(0)
    dev = torch.device("cuda:0")
    stream = torch.cuda.Stream()
    a = torch.randn(args.tokens, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16) / 45
    mailbox = torch.zeros(8, dtype=torch.int64, device=dev)
    event = torch.cuda.Event(interprocess=True)
    event.record(stream)
    torch.cuda.synchronize()
    # calibrate the number of matmuls to about forward_ms of GPU time
    with torch.cuda.stream(stream):
        _forward(a, w, 8)
        t = time.perf_counter()
        _forward(a, w, 40)
        stream.synchronize()
    per = (time.perf_counter() - t) / 40
    n = max(4, int(args.forward_ms / 1000 / per))
    to_c.put(("setup", event.ipc_handle(), mailbox))
    from_c.get(timeout=60)
    results = []
    for trial in range(args.trials * len(MODES)):
        mode = MODES[trial % len(MODES)]
        time.sleep(0.02)  # both idle between trials
        t0 = time.monotonic_ns()
        with torch.cuda.stream(stream):
            x = _forward(a, w, n)
            mailbox[0] = x[0, 0].view(torch.int16).to(torch.int64) + trial  # the "token"
            event.record(stream)
        if mode in ("pending", "poll"):
            to_c.put((mode, trial))
        stream.synchronize()
        t1 = time.monotonic_ns()
        if mode == "after":
            to_c.put((mode, trial))
        done_ns = from_c.get(timeout=60) if mode != "alone" else t1
        results.append((mode, (t1 - t0) / 1e6, (done_ns - t1) / 1e6))
    to_c.put(("stop", 0))
    ctl.put(("results", n, results, from_c.get(timeout=60)))


def _consumer(to_c: mp.Queue, from_c: mp.Queue, args: argparse.Namespace) -> None:
    torch.cuda.set_device(0)
    dev = torch.device("cuda:0")
    stream = torch.cuda.Stream()
    _, handle, mailbox = to_c.get(timeout=60)
    event = torch.cuda.Event.from_ipc_handle(0, handle)
    ws = [torch.randn(2048, 5632, device=dev, dtype=torch.bfloat16) / 75 for _ in range(4)]
    x = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    out = torch.empty(8, dtype=torch.int64, device=dev)

    def step() -> None:
        y = x + mailbox[0].to(torch.bfloat16) * 0
        for i in range(args.step_gemvs):
            y = (y @ ws[i % 4])[:, :2048]
        out[0] = y[0, 0].view(torch.int16).to(torch.int64)

    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    stream.synchronize()
    if args.graph:  # one launch for the whole step, as the decode replays its graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step()
        step = graph.replay
    from_c.put("ready")
    while True:
        kind, _ = to_c.get(timeout=120)
        if kind == "stop":
            break
        if kind == "poll":  # the host watches the event, then launches
            while not event.query():
                pass
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            step()
        stream.synchronize()
        from_c.put(time.monotonic_ns())
    solo = []  # the step alone: launch → host saw it end
    for _ in range(20):
        t = time.monotonic_ns()
        with torch.cuda.stream(stream):
            step()
        stream.synchronize()
        solo.append((time.monotonic_ns() - t) / 1e6)
    from_c.put(round(statistics.median(solo), 3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=40, help="per mode")
    p.add_argument("--forward-ms", type=float, default=12.0)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--step-gemvs", type=int, default=60)
    p.add_argument("--graph", action="store_true", help="replay the step as one CUDA graph")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    ctl, to_c, from_c = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_producer, args=(ctl, to_c, from_c, args), daemon=True),
        ctx.Process(target=_consumer, args=(to_c, from_c, args), daemon=True),
    ]
    for proc in procs:
        proc.start()
    _, n, results, solo = ctl.get(timeout=600)
    for proc in procs:
        proc.join(timeout=30)
    summary: dict[str, dict[str, float]] = {}
    for mode in MODES:
        rows = [r for r in results if r[0] == mode][2:]  # the first two of each warm up
        fwd = sorted(r[1] for r in rows)
        gap = sorted(r[2] for r in rows)
        summary[mode] = {
            "forward_ms_p50": round(statistics.median(fwd), 3),
            "forward_ms_p90": round(fwd[int(0.9 * (len(fwd) - 1))], 3),
            "gap_ms_p50": round(statistics.median(gap), 3),
            "gap_ms_p90": round(gap[int(0.9 * (len(gap) - 1))], 3),
        }
        print(f"{mode:8s} {summary[mode]}")
    print(f"the step alone (launch → host saw it end): {solo} ms")
    out = {"bench": "pending_wait", "matmuls": n, "trials": args.trials, "step_ms": solo}
    print(json.dumps({**out, **summary}))


if __name__ == "__main__":
    main()
