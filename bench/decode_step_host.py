"""The decode's host work per step, without the prefill: a batch of B greedy sequences of the tiny
model on CPU, stepped by the decode's own request table (DecodeEngine.step, then
DecodeRequests.step_done with each step's frames encoded for a link that discards them). Per
step: the whole step's time, the forward's own (`model.decode_step`, timed around the call), and
their difference, the host work the step adds to its forward (inputs, draw, answers, encoding).
Times are the process's CPU time (every thread; torch runs one), which other jobs on a shared
machine do not inflate the way they inflate wall-clock time.
Median over `--steps` steps after `--warmup`, `--repeat` times (the median of those medians).

    .venv/bin/python bench/decode_step_host.py [--batch 64 256] [--steps 50] [--repeat 3]

Numbers go to docs/benchmarks.md by hand, with the machine they were taken on.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common.daemon import logs  # noqa: E402
from common.daemon.runtime import ModelRuntime  # noqa: E402
from common.protocol import Message, encode  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from decode_server.config import DecodeConfig  # noqa: E402
from decode_server.phase import Phase  # noqa: E402
from decode_server.requests import DecodeRequests  # noqa: E402
from decode_server.sequence import Sequence, blocks_needed  # noqa: E402
from decode_server.startup import load_runtime  # noqa: E402


class NullPeer:
    """A link whose frames are encoded, as the real one does, and dropped."""

    link_id = "link-bench"
    frames = 0

    def post(self, msg: Message) -> None:
        self.post_many([msg])

    def post_many(self, msgs: list[Message]) -> None:
        self.frames += len(msgs)
        b"".join(encode(m) for m in msgs)


def fill(table: DecodeRequests, rt: ModelRuntime, batch: int, steps: int) -> None:
    peer = NullPeer()
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    bs, prompt = rt.layout.block_size, 24
    for i in range(batch):
        rid = f"bench-{i:04d}-0123456789abcdef"
        need = blocks_needed(prompt, params.max_tokens, bs)
        seq = Sequence(
            request_id=rid,
            link=peer,  # type: ignore[arg-type]
            prompt_len=prompt,
            generated=[65 + i % 26],
            blocks=[],
            sampling=params,
            stop_ids=rt.model.config.stop_token_ids,
            block_size=bs,
        )
        seq.blocks = rt.allocator.allocate(seq.key, need)
        seq.phase = Phase.DECODING
        table._table[seq.key] = seq
        table.engine.add(seq)


async def one_run(rt: ModelRuntime, batch: int, steps: int, warmup: int) -> tuple[float, float]:
    table = DecodeRequests(rt, max_batch=batch)
    fill(table, rt, batch, steps + warmup)
    forward_ns = [0]
    inner = rt.model.decode_step

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.process_time_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            forward_ns[0] += time.process_time_ns() - t

    rt.model.decode_step = timed  # type: ignore[method-assign]
    totals, hosts = [], []
    try:
        for k in range(steps + warmup):
            forward_ns[0] = 0
            t = time.process_time_ns()
            table.step_done(await table.engine.step())
            total = time.process_time_ns() - t
            if k >= warmup:
                totals.append(total / 1e3)
                hosts.append((total - forward_ns[0]) / 1e3)
    finally:
        rt.model.decode_step = inner  # type: ignore[method-assign]
        for seq in list(table._table.values()):
            table.engine.remove(seq.key)
            rt.allocator.free(seq.key)
    return statistics.median(totals), statistics.median(hosts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    logs.configure(level="WARNING")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = DecodeConfig(runtime_dir=Path(tmp), device="cpu", num_blocks=8192)
        rt = load_runtime(cfg)
        try:
            for batch in args.batch:
                runs = [
                    asyncio.run(one_run(rt, batch, args.steps, args.warmup))
                    for _ in range(args.repeat)
                ]
                total = statistics.median(r[0] for r in runs)
                host = statistics.median(r[1] for r in runs)
                print(
                    f"batch {batch:4d}: step {total:9.1f} µs, forward {total - host:9.1f} µs, "
                    f"host {host:8.1f} µs ({host / batch:.2f} µs a sequence)"
                )
        finally:
            rt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
