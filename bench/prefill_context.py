"""The prefill forward with a cached prefix against the whole prompt, one GPU, one process.

What a prefix-cache hit saves depends on the forward over the uncached part costing what its
tokens cost. This measures, on the model of `--model` (e.g. the random 1.1B checkpoint
`bench/engine.py --save-checkpoint DIR` writes), with the daemon's own pieces (`ModelRuntime.load`,
`run_prefill_batch` on its torch thread and stream, the first token drawn; a forward that fits
the prefill's CUDA graphs (`--graph-tokens`) replays one, and each case runs again launched
eagerly):

  full    the whole prompt (--prefix + --own tokens) computed;
  own     only --own tokens, no context (the floor of a hit);
  cached  --own tokens after --prefix cached tokens read from the pool (the paged-context kernel);

median wall ms of each (device synchronized), then, with --profile, torch.profiler's top CUDA
kernels of `cached` and `full`. JSON lines, and all of it to --out.

    python3 bench/prefill_context.py --model /tmp/pdkv-llama-1.1b --prefix 1536 --own 128
    python3 bench/prefill_context.py --model /tmp/pdkv-llama-1.1b --prefix 1872 --own 128 \
        --graph-tokens 2048    # a 2,000-token prompt's forward replayed against launched
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from common.model.sampling import SamplingParams
from prefill_server.config import PrefillConfig
from prefill_server.forward import Piece, run_prefill_batch
from prefill_server.startup import load_runtime

RESULTS: dict[str, float] = {}


def report(name: str, value: float, unit: str) -> None:
    RESULTS[f"{name} [{unit}]"] = round(value, 3)
    print(json.dumps({"name": name, "value": round(value, 3), "unit": unit}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the tiny model)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--own", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--graph-tokens",
        type=int,
        default=PrefillConfig().prefill_graph_tokens,
        help="the prefill's --prefill-graph-tokens: forwards up to this many tokens are replayed "
        "(e.g. 2048 to replay a 2,000-token prompt's)",
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("prefill_context.json"))
    args = ap.parse_args()
    cfg = PrefillConfig(
        model=args.model,
        device=args.device,
        allow_byte_tokenizer=True,
        num_blocks=1024,
        torch_threads=2,
        prefill_graph_tokens=args.graph_tokens,
    )
    rt = load_runtime(cfg)
    bs = rt.layout.block_size
    g = torch.Generator().manual_seed(0)
    n = args.prefix + args.own
    prompt = torch.randint(3, rt.model.config.vocab_size, (n,), generator=g).tolist()
    blocks = list(range(1, -(-n // bs) + 1))
    params = SamplingParams(max_tokens=8)

    def sync() -> None:
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)

    def run(pieces: list[Piece]) -> None:
        rt.executor.submit(run_prefill_batch, rt, pieces, None, token_budget=n).result()

    cases = {
        "full": [Piece(prompt, 0, n, blocks, params)],
        "own": [Piece(prompt[: args.own], 0, args.own, blocks, params)],
        "cached": [Piece(prompt, args.prefix, n, blocks, params)],
    }
    graphs = rt.graphs
    run(cases["full"])  # writes the prefix's K/V for `cached`
    runs = [(name, pieces, graphs) for name, pieces in cases.items()]
    if graphs is not None:  # each again launched eagerly, in the same process
        runs += [(f"{name}, eager", pieces, None) for name, pieces in cases.items()]
    for name, pieces, use in runs:
        rt.graphs = use
        for _ in range(3):
            run(pieces)
        times = []
        for _ in range(args.reps):
            sync()
            t0 = time.perf_counter()
            run(pieces)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        report(
            f"{name} ({pieces[0].end - pieces[0].start} computed)", statistics.median(times), "ms"
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        # replayed (a graph's kernels) and launched (each kernel's own time, and what the host
        # adds between them: the wall against the kernels' sum)
        profiled = [("cached", graphs), ("cached", None), ("own", None), ("full", None)]
        if graphs is not None and graphs.bucket_for([n], [len(blocks)]) is not None:
            profiled.append(("full", graphs))  # the whole prompt replayed (--graph-tokens >= it)
        for name, use in profiled:
            rt.graphs = use
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    run(cases[name])
                sync()
            print(f"== {name}{'' if use is not None else ', eager'} (3 runs)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    args.out.write_text(json.dumps({"device": str(rt.device), "results": RESULTS}))


if __name__ == "__main__":
    main()
