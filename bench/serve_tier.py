"""`bench/serve.py --target tier --turns T`: conversations whose every turn re-sends the whole
conversation, the model's own answers included, through a pair with the host KV tier
(`--host-cache-gb`) and a pair without it, one workload (issue 43).

`--requests` conversations start at `--rate` (Poisson; inf: all at once); each sends its turns one
after another: turn 0 a prompt drawn from `--prompt-len`, turn k the conversation so far (every
prompt and the answer the daemons gave to it) and a new message drawn from `--message-len`.
`--output-len` tokens per answer (greedy, EOS ignored). Per turn: TTFT p50/p99 and the prefill's
computed tokens (prompt - cached_tokens). The pool (`--num-blocks`, both daemons) should be much
smaller than the conversations' KV, so that without the tier an evicted history is recomputed:
the run prints the ratio. Both pairs must give the same tokens (greedy): checked.

    python bench/serve.py --target tier --turns 8 --requests 32 --prompt-len 128:128 \
        --message-len 32:32 --output-len 32:32 --num-blocks 480 --host-cache-gb 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path

import numpy as np
from serve_daemons import ServerTimings, daemon_stream, own_pair


def conversations(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """Per conversation, the new part of each turn (turn 0: its first prompt)."""
    rng = random.Random(args.seed + 43)
    out = []
    for _ in range(args.requests):
        parts = [[rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_len))]]
        for _ in range(args.turns - 1):
            parts.append([rng.randrange(vocab) for _ in range(rng.randint(*args.message_len))])
        out.append(parts)
    return out


async def _converse(sock: str, parts: list[list[int]], out_len: int, delay: float) -> list[dict]:
    await asyncio.sleep(delay)
    history: list[int] = []
    turns = []
    for turn, part in enumerate(parts):
        prompt = history + part
        start = time.perf_counter()
        first = None
        answer: list[int] = []
        cached = 0
        async for item in daemon_stream(sock, prompt, out_len, shared=True):
            if isinstance(item, ServerTimings):
                cached = int(item.values.get("cached_tokens", 0))
            else:
                first = first or time.perf_counter()
                answer += item
        assert first is not None, "no token"
        turns.append(
            {
                "turn": turn,
                "prompt": len(prompt),
                "cached": cached,
                "ttft_ms": (first - start) * 1e3,
                "answer": answer,
            }
        )
        history = prompt + answer
    return turns


async def _run_all(sock: str, convs: list[list[list[int]]], args: argparse.Namespace) -> list:
    rng = np.random.default_rng(args.seed)
    gaps = (
        rng.exponential(1 / args.rate, len(convs)) if np.isfinite(args.rate) else [0] * len(convs)
    )
    starts = np.cumsum(gaps)
    jobs = [
        _converse(sock, c, args.output_len[0], float(s)) for c, s in zip(convs, starts, strict=True)
    ]
    return await asyncio.gather(*jobs)


def summarize(results: list[list[dict]]) -> dict[int, dict]:
    by_turn: dict[int, dict] = {}
    for turn in range(len(results[0])):
        rows = [conv[turn] for conv in results]
        ttft = np.array([r["ttft_ms"] for r in rows])
        computed = np.array([r["prompt"] - r["cached"] for r in rows])
        by_turn[turn] = {
            "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "prompt_mean": float(np.mean([r["prompt"] for r in rows])),
            "computed_mean": float(computed.mean()),
        }
    return by_turn


def run(args: argparse.Namespace, common: list[str], vocab: int) -> list[dict]:
    """Both pairs on one workload; one result per pair (`host_tier` on, off)."""
    if args.output_len[0] != args.output_len[1]:
        raise SystemExit("--target tier: give one --output-len (MIN == MAX)")
    convs = conversations(args, vocab)
    final = [sum(map(len, c)) + (len(c) - 1) * args.output_len[0] for c in convs]
    kv_blocks = sum(-(-n // args.block_size) for n in final)
    print(f"  conversations' KV: {kv_blocks} blocks, {kv_blocks / args.num_blocks:.1f}x the pool")
    # the decode holds every conversation's last turn at once (its pool is not what is measured:
    # the prefill's prefix lookup is); the prefill's is --num-blocks
    decode = ["--max-batch", str(args.max_batch)]
    decode += [
        "--num-blocks",
        str(max(args.num_blocks, max(final) // args.block_size * len(convs) + len(convs) * 4)),
    ]
    runs = []
    tier = Path(f"/dev/shm/pdkv-bench-tier-{os.getpid()}")  # its own, removed at the end
    for on in (True, False):
        extra = ["--host-cache-gb", str(args.host_cache_gb), "--host-cache-path", str(tier)]
        with own_pair(common + (extra if on else []), decode) as sock:
            warm = argparse.Namespace(**{**vars(args), "requests": 1, "seed": args.seed + 1})
            asyncio.run(_run_all(sock, [[p[:16] for p in conversations(warm, vocab)[0][:2]]], args))
            t0 = time.perf_counter()
            results = asyncio.run(_run_all(sock, convs, args))
            took = time.perf_counter() - t0
        tier.unlink(missing_ok=True)
        runs.append({"host_tier": on, "duration_s": took, "turns": summarize(results),
                     "answers": [[t["answer"] for t in c] for c in results]})  # fmt: skip
    same = runs[0]["answers"] == runs[1]["answers"]
    print_table(runs, same)
    for c, (a, b) in enumerate(zip(runs[0]["answers"], runs[1]["answers"], strict=True)):
        for t, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                at = next(i for i, (u, v) in enumerate(zip(x, y, strict=True)) if u != v)
                print(f"  differ: conversation {c}, turn {t + 1}, token {at}")
                break
    if not same:
        runs[0]["parts"] = convs  # replayable: the answers are kept
        return runs
    for r in runs:
        del r["answers"]
    return runs


def print_table(runs: list[dict], same: bool) -> None:
    print(f"{'turn':>4} | {'prompt':>6} | " + " | ".join(
        f"{'tier ' + ('on' if r['host_tier'] else 'off'):>9} TTFT p50 / computed" for r in runs))  # fmt: skip
    for turn in runs[0]["turns"]:
        row = [f"{runs[0]['turns'][turn]['prompt_mean']:6.0f}"]
        for r in runs:
            t = r["turns"][turn]
            row.append(f"{t['ttft_p50_ms']:9.1f} ms / {t['computed_mean']:8.0f}")
        print(f"{turn + 1:>4} | " + " | ".join(row))
    for r in runs:
        t = r["turns"]
        last = max(t)
        ratio = t[last]["ttft_p50_ms"] / t[0]["ttft_p50_ms"]
        on = "on" if r["host_tier"] else "off"
        print(
            f"tier {on}: turn {last + 1} / turn 1 TTFT p50 = {ratio:.2f}x, {r['duration_s']:.1f} s"
        )
    print("tokens equal with the tier on and off:", same)


__all__ = ["run"]
