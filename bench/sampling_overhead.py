"""What the sampling features cost one decode step's draw (common.model.sampling.draw): a batch of
B rows of a real vocabulary's logits, greedy, with every row penalized, with every row asking
for 20 logprobs, and with both; median of repeated draws, the device synchronized after each.

    python bench/sampling_overhead.py [--device cuda] [--vocab 49152] [--batch 1 16 64 256]

Prints one line per (batch, case): the draw's median time in µs and its excess over greedy.
Numbers go to docs/benchmarks.md by hand, with the machine they were taken on.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.model.logits import TokenHistory
from common.model.sampling import draw, make_generator
from common.sampling_params import SamplingParams

CASES = {
    "greedy": SamplingParams(max_tokens=64),
    "penalties": SamplingParams(
        max_tokens=64, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2
    ),
    "logprobs20": SamplingParams(max_tokens=64, logprobs=20),
    "both": SamplingParams(
        max_tokens=64, logprobs=20, presence_penalty=0.5, repetition_penalty=1.2
    ),
}


def time_draw(
    logits: torch.Tensor, params: SamplingParams, history_len: int, repeats: int
) -> float:
    """Median µs of one step's draw for every row of `logits` with `params` (histories of
    `history_len` prompt and generated tokens each, caught up by one token a step)."""
    b, vocab = logits.shape
    gen = torch.Generator().manual_seed(0)
    histories = [
        TokenHistory.start(
            torch.randint(vocab, (history_len,), generator=gen).tolist(),
            torch.randint(vocab, (history_len,), generator=gen).tolist(),
            vocab,
            logits.device,
        )
        if params.penalized
        else None
        for _ in range(b)
    ]
    generated = [list(range(history_len)) for _ in range(b)]
    times = []
    for step in range(repeats):
        sync(logits)
        t0 = time.perf_counter()
        for h, g in zip(histories, generated, strict=True):
            g.append(step % vocab)
            if h is not None:
                h.catch_up(g)
        draw(
            logits,
            [params] * b,
            [make_generator(params, history_len + step)] * b,
            steps=[history_len + step] * b,
            histories=histories,
            eos_ids={0},
        )
        sync(logits)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def sync(x: torch.Tensor) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--history", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    for b in args.batch:
        logits = torch.randn(b, args.vocab, device=args.device) * 4
        base = None
        for name, params in CASES.items():
            us = time_draw(logits, params, args.history, args.repeats)
            base = us if base is None else base
            print(f"batch {b:4d}  {name:10s}  {us:9.1f} µs  (+{us - base:8.1f} µs over greedy)")


if __name__ == "__main__":
    main()
