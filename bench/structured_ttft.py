"""What a JSON schema adds to a request's TTFT through the daemons (issue 42 target: a schema's
first use ≤ 50 ms more than an unconstrained request, a cached schema ≤ 1 ms).

One pair of its own (bench/serve_daemons.own_pair), then for each of N distinct schemas, one
request at a time, three requests of the same prompt length (each prompt new, so the prefix cache
serves none of them), in an order drawn for each schema: unconstrained, the schema's first use
(compiled at the prefill's admission, and at the decode's HANDOFF meanwhile), the same schema
again (the caches' hit) after its first use. TTFT is the client's: GENERATE sent to the first
TOKENS frame. Reported: the medians of each kind and of the per-schema differences from the
unconstrained request beside it (the machine's drift cancels), and with --stages the medians of
the daemons' own timings (FINISH's) by kind: where a difference comes from.

    .venv/bin/python bench/structured_ttft.py                      # SmolLM2 (pdkv model get)
    .venv/bin/python bench/structured_ttft.py --model tiny --schemas 40
    python3 bench/structured_ttft.py --model /tmp/pdkv-llama-1.1b --device cuda:0 \
        --allow-byte-tokenizer          # one GPU, TinyLlama-1.1B's shape (random weights)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve_daemons import own_pair  # noqa: E402

from common import client  # noqa: E402
from common.sampling_params import SamplingParams, StructuredOutput  # noqa: E402

KINDS = ("plain", "first", "cached")
#: the orders of one schema's three requests (its first use before its cached one)
ORDERS = (("plain", "first", "cached"), ("first", "plain", "cached"), ("first", "cached", "plain"))


def schema(i: int) -> dict:
    """The i-th schema: the same shape under names of its own (each one compiles anew)."""
    return {
        "type": "object",
        "properties": {
            f"name_{i}": {"type": "string", "maxLength": 24},
            f"count_{i}": {"type": "integer", "minimum": 0, "maximum": 1000},
            f"tags_{i}": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
            f"ok_{i}": {"type": "boolean"},
        },
        "required": [f"name_{i}", f"count_{i}"],
        "additionalProperties": False,
    }


TIMINGS: dict[str, list[dict]] = {k: [] for k in KINDS}


async def ttft(
    sock: str, prompt: list[int], spec: StructuredOutput | None, out: int, kind: str = ""
) -> float:
    """Seconds from the request to its first TOKENS frame (the rest is read and dropped); the
    daemons' own timings of it (FINISH) kept in TIMINGS[kind]."""
    params = SamplingParams(max_tokens=out, structured=spec)
    started, first = time.perf_counter(), None
    async for msg in client.stream(sock, prompt_tokens=prompt, sampling=params, timeout=120):
        if first is None and isinstance(msg, client.Tokens) and msg.tokens:
            first = time.perf_counter() - started
        elif isinstance(msg, client.Finish) and msg.timings and kind:
            TIMINGS[kind].append(dict(msg.timings))
    assert first is not None, "no token came"
    return first


async def run(sock: str, args: argparse.Namespace) -> dict[str, list[float]]:
    rng = random.Random(args.seed)
    vocab = args.vocab

    def prompt() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(args.prompt_len)]

    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(args.warmup):  # the pair's first requests (allocations, the first compile)
        await ttft(sock, prompt(), StructuredOutput("json_object", ""), args.output_len)
    for i in range(args.schemas):
        spec = StructuredOutput("json_schema", json.dumps(schema(i)))
        order = rng.choice(ORDERS)  # the unconstrained one anywhere: what precedes cancels out
        for kind in order:
            asked = None if kind == "plain" else spec
            times[kind].append(await ttft(sock, prompt(), asked, args.output_len, kind))
    return times


def stages() -> dict[str, dict[str, float]]:
    """The median of each of the daemons' timings (FINISH), by kind: where a difference is."""
    out: dict[str, dict[str, float]] = {}
    for kind, rows in TIMINGS.items():
        keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, int | float)})
        out[kind] = {k: statistics.median(r.get(k, 0) for r in rows) for k in keys}
    return out


def summary(times: dict[str, list[float]]) -> dict[str, float]:
    ms = {k: [t * 1e3 for t in v] for k, v in times.items()}
    out = {f"{k}_p50_ms": round(statistics.median(v), 2) for k, v in ms.items()}
    for k in ("first", "cached"):
        diffs = [a - b for a, b in zip(ms[k], ms["plain"], strict=True)]
        out[f"{k}_minus_plain_p50_ms"] = round(statistics.median(diffs), 2)
        out[f"{k}_minus_plain_max_ms"] = round(max(diffs), 2)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a checkpoint dir, smollm2, or tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument(
        "--allow-byte-tokenizer",
        action="store_true",
        help="a --model without tokenizer.json (bench/engine.py's random checkpoints)",
    )
    p.add_argument("--schemas", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=2, help="2: the request reaches the decode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stages", action="store_true", help="print the daemons' timings too")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    return p.parse_args(argv)


def model_opts(args: argparse.Namespace) -> list[str]:
    """The daemons' --model (and --dtype, --device); sets args.vocab for the prompts."""
    if args.model == "tiny":
        args.vocab = 256
        opts = []
    else:
        path = args.model
        if path == "smollm2":
            from pdkv import models

            path = str(models.ensure())
        args.vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        opts = ["--model", path]
    opts += ["--device", args.device]
    if args.allow_byte_tokenizer:
        opts.append("--allow-byte-tokenizer")
    return opts + (["--dtype", args.dtype] if args.dtype else [])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    opts = model_opts(args)
    with own_pair(opts, []) as sock:
        times = asyncio.run(run(sock, args))
    result = {"model": args.model, "device": args.device, "schemas": args.schemas, **summary(times)}
    result["ms"] = {k: [round(t * 1e3, 2) for t in v] for k, v in times.items()}
    result["stages"] = stages()
    print(json.dumps({k: v for k, v in result.items() if k not in ("ms", "stages")}, indent=1))
    if args.stages:
        print(json.dumps(result["stages"], indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
