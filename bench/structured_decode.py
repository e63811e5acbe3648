"""What a grammar costs the decode's step (issue 42 target: ≥ 0.90× at batch 64 with every
sequence under a JSON schema, nothing without one): B greedy sequences stepped by the decode's own
request table (DecodeEngine.step, DecodeRequests.step_done), unconstrained, then each under a JSON
schema that cannot end within the run (so the batch stays whole), then half and half. Per step:
the median wall time over `--steps` after `--warmup`, and the grammar's own share: the masks
filled on the host (`StepMasks.fill`) and the masked pass (`bitmask.apply`), timed apart.

On the CPU the forward runs on the host thread, so the masks' time adds to the step as measured
(no overlap possible): an upper bound of the cost. On CUDA the masks are filled after the step's
kernels are queued, while the GPU runs them.

    .venv/bin/python bench/structured_decode.py [--model DIR] [--batch 1 64] [--steps 30]
    # one GPU, TinyLlama-1.1B's shape (random bf16 weights, byte tokenizer for the grammar):
    python3 bench/structured_decode.py --device cuda:0 --shape tinyllama-1.1b --steps 50 \
        --overlap-steps always
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import decode_server.grammars as grammars_mod  # noqa: E402
from common.daemon import logs  # noqa: E402
from common.daemon.runtime import ModelRuntime  # noqa: E402
from common.model import sampling as sampling_mod  # noqa: E402
from common.sampling_params import SamplingParams, StructuredOutput  # noqa: E402
from decode_server.config import DecodeConfig  # noqa: E402
from decode_server.grammars import start  # noqa: E402
from decode_server.phase import Phase  # noqa: E402
from decode_server.requests import DecodeRequests  # noqa: E402
from decode_server.sequence import Sequence, blocks_needed  # noqa: E402


class NullPeer:
    """A link whose frames are dropped (bench/decode_step_host.py's, without the encoding)."""

    link_id = "link-bench"

    def post(self, msg: object) -> None:
        pass

    def post_many(self, msgs: list) -> None:
        pass


SCHEMA = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "n": {"type": "integer"},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
                },
                "required": ["name", "n", "tags"],
            },
        }
    },
    "required": ["rows"],
}
TIMED = {"fill": 0, "apply": 0}
OVERLAP = ["off"]  # --overlap-steps as the engine takes it


def _timed(fn, key: str):  # type: ignore[no-untyped-def]
    def wrapper(*args, **kw):  # type: ignore[no-untyped-def]
        t = time.perf_counter_ns()
        try:
            return fn(*args, **kw)
        finally:
            TIMED[key] += time.perf_counter_ns() - t

    return wrapper


def fill(table: DecodeRequests, rt: ModelRuntime, batch: int, steps: int, constrained: int) -> None:
    peer = NullPeer()
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    bs, prompt = rt.layout.block_size, 24
    stops = rt.model.config.stop_token_ids
    brace = rt.tokenizer.encode("{")[-1]  # the answer's first token, as the prefill drew it
    for i in range(batch):
        params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
        if i < constrained:
            params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, structured=spec)
        seq = Sequence(
            request_id=f"bench-{i:04d}-0123456789abcdef",
            link=peer,  # type: ignore[arg-type]
            prompt_len=prompt,
            generated=[],
            blocks=[],
            sampling=params,
            stop_ids=stops,
            block_size=bs,
            grammar=start(rt, params, stops),
        )
        seq.generated.append(brace if i < constrained else 65 + i % 26)
        seq.blocks = rt.allocator.allocate(seq.key, blocks_needed(prompt, params.max_tokens, bs))
        seq.phase = Phase.DECODING
        table._table[seq.key] = seq
        table.engine.add(seq)


async def one_run(
    rt: ModelRuntime, batch: int, steps: int, warmup: int, constrained: int
) -> tuple[float, float, float]:
    table = DecodeRequests(rt, max_batch=batch, overlap=OVERLAP[0])
    fill(table, rt, batch, steps + warmup, constrained)
    walls, fills, applies = [], [], []
    try:
        for k in range(steps + warmup):
            TIMED["fill"] = TIMED["apply"] = 0
            t = time.perf_counter_ns()
            table.step_done(await table.engine.step())
            if k >= warmup:
                walls.append((time.perf_counter_ns() - t) / 1e6)
                fills.append(TIMED["fill"] / 1e6)
                applies.append(TIMED["apply"] / 1e6)
        assert len(table.engine) == batch, "a sequence ended: the batch shrank"
    finally:
        for seq in list(table._table.values()):
            table.engine.remove(seq.key)
            rt.allocator.free(seq.key)
    return statistics.median(walls), statistics.median(fills), statistics.median(applies)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: tiny)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--overlap-steps",
        choices=("off", "always"),
        default="off",
        help="always: steps launched ahead (greedy constrained rows too), the CUDA default",
    )
    ap.add_argument("--dtype", default=None)
    ap.add_argument(
        "--shape",
        default=None,
        help="build a random checkpoint of this bench/engine.py shape (on cuda:0) as --model",
    )
    args = ap.parse_args()
    logs.configure(level="WARNING")
    OVERLAP[0] = args.overlap_steps
    torch.set_num_threads(args.threads)
    grammars_mod.StepMasks.fill = _timed(grammars_mod.StepMasks.fill, "fill")  # type: ignore[method-assign]
    sampling_mod.bitmask.apply = _timed(sampling_mod.bitmask.apply, "apply")  # type: ignore[method-assign]
    grammars_mod.bitmask.masked_argmax = _timed(grammars_mod.bitmask.masked_argmax, "apply")  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.shape is not None:
            from engine import build_checkpoint  # bench/engine.py

            model = Path(tmp) / "ckpt"
            build_checkpoint(model, args.shape)
            torch.cuda.empty_cache()
        cfg = DecodeConfig(
            runtime_dir=Path(tmp),
            device=args.device,
            dtype=args.dtype,
            num_blocks=8192,
            model=None if model is None else str(model),
            allow_byte_tokenizer=args.shape is not None,
        )
        rt = load(cfg)
        try:
            for batch in args.batch:
                base = None
                for label, k in (("none", 0), ("half", batch // 2), ("all", batch)):
                    if label == "half" and batch < 2:
                        continue
                    wall, fill_ms, apply_ms = asyncio.run(
                        one_run(rt, batch, args.steps, args.warmup, k)
                    )
                    base = wall if base is None else base
                    print(
                        f"batch {batch:3d} constrained {label:4s}: step {wall:8.2f} ms "
                        f"(masks filled {fill_ms:6.2f} ms, applied {apply_ms:6.2f} ms) "
                        f"throughput {base / wall:.3f}x",
                        flush=True,
                    )
        finally:
            rt.close()
    return 0


def load(cfg: DecodeConfig) -> ModelRuntime:
    from decode_server.startup import load_runtime

    return load_runtime(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
