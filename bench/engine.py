"""pdkv's engine against HF transformers at a model's shape, one GPU, one run.

Builds a random-weight checkpoint of that shape with transformers (on the GPU, bf16, nothing
downloaded; `--shape`: TinyLlama-1.1B's by default, or Llama-3-8B's or Qwen3-8B's), saves it with
`save_pretrained`, loads it with pdkv's loader, then measures both:
TTFT of a 2048-token prompt; 16 × 512-token prompts prefilled together; the decode step at batch 1,
16 and 64 (context 512); 16 × (512 prompt + 128 new) greedy; nano-vllm's shape (256 sequences,
prompt and output lengths random in 100–1024, seed 0) in output tokens/s; and the weight-bandwidth
floor of a step. Prints a JSON line per figure and writes them all to --out.

    python3 bench/engine.py --out results.json [--profile profile.txt]
    python3 bench/engine.py --shape qwen3-8b --out qwen3.json   # 64 rows, no HF side by default

At the 8B shapes the pool holds 64 rows (--rows; 2 GiB of KV a row at 2,048 tokens would not fit
256 beside the weights), so nano-vllm's 256-sequence burst is skipped, and the HF side (a second
copy of the weights) only runs with --hf.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from common.model import load_model, slots_for
from common.model.prefill import prefill_many
from common.model.runner import DecodeRunner

#: name -> (transformers config class, model class, config fields)
SHAPES: dict[str, tuple[str, str, dict[str, object]]] = {
    "tinyllama-1.1b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 22,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "max_position_embeddings": 2048,
        },
    ),
    "llama3-8b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            # Llama-3.1-8B's context (Llama-3's 8192 leaves no room after an 8192-token prompt);
            # its llama3 RoPE scaling is left out: random weights, the compute is the same
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
        },
    ),
    "qwen3-8b": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 8192,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
    ),
}
SHAPE = dict(SHAPES["tinyllama-1.1b"][2])  # the shape measured: main() sets it from --shape
BLOCK = 16
MAX_BLOCKS = 2048 // BLOCK
RESULTS: dict[str, float] = {}


def report(name: str, value: float, unit: str) -> None:
    RESULTS[f"{name} [{unit}]"] = round(value, 3)
    print(json.dumps({"name": name, "value": round(value, 3), "unit": unit}), flush=True)


def timed(fn: Callable[[], object], reps: int, warm: int = 2) -> float:
    """Median wall time of fn() in ms, the device synchronized around each call."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build_checkpoint(path: Path, shape: str = "tinyllama-1.1b"):
    import transformers

    config_cls, model_cls, fields = SHAPES[shape]
    config = getattr(transformers, config_cls)(**fields, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        hf = getattr(transformers, model_cls)(config)
    hf = hf.to(torch.bfloat16).eval()
    hf.save_pretrained(path)
    return hf


class Pdkv:
    """The loaded model, one pool, one graph runner; rows get blocks 1.. in order of use."""

    def __init__(self, path: Path, rows: int) -> None:
        self.model, _ = load_model(
            path, device="cuda:0", dtype=torch.bfloat16, allow_byte_tokenizer=True
        )
        self.kv = self.model.new_kv_cache(rows * MAX_BLOCKS + 1, BLOCK)
        self.runner = DecodeRunner(self.model, self.kv, max_batch=rows, max_blocks=MAX_BLOCKS)
        t0 = time.perf_counter()
        self.runner.capture()
        report("graph capture, all buckets", time.perf_counter() - t0, "s")
        self.tables = np.arange(1, rows * MAX_BLOCKS + 1, dtype=np.int64).reshape(rows, MAX_BLOCKS)

    def prefill(self, prompts: list[list[int]], budget: int = 16384) -> list[int]:
        slots = [slots_for(self.tables[i], 0, len(p), BLOCK) for i, p in enumerate(prompts)]
        tokens = [torch.tensor(p) for p in prompts]
        logits = prefill_many(self.model, tokens, slots, self.kv, token_budget=budget)
        return logits.argmax(-1).tolist()

    def step(self, rows: np.ndarray, tokens: list[int], positions: np.ndarray) -> list[int]:
        tables = self.tables[rows]
        slots = tables[np.arange(len(rows)), positions // BLOCK] * BLOCK + positions % BLOCK
        argmax, _ = self.runner.run(tokens, positions, slots, tables)
        return argmax.tolist()

    def generate(self, prompts: list[list[int]], out_lens: list[int]) -> int:
        """Greedy, every row to its own output length; returns tokens generated. Every row's
        first token comes from one prefill of all the prompts: its time (`last_prefill_s`) is
        each row's TTFT."""
        t0 = time.perf_counter()
        first = self.prefill(prompts)
        self.last_prefill_s = time.perf_counter() - t0  # prefill() returns host tokens: synced
        last = np.array(first, dtype=np.int64)
        done = np.ones(len(prompts), dtype=np.int64)
        plen = np.array([len(p) for p in prompts], dtype=np.int64)
        want = np.array(out_lens, dtype=np.int64)
        while True:
            rows = np.nonzero(done < want)[0]
            if rows.size == 0:
                return int(done.sum())
            last[rows] = self.step(rows, last[rows].tolist(), plen[rows] + done[rows] - 1)
            done[rows] += 1


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, SHAPE["vocab_size"], (n, length), generator=g).tolist()


def bench_prefill(pd: Pdkv, hf) -> None:
    prompt = random_prompts(1, 2048, 1)
    report("pdkv TTFT 2048", timed(lambda: pd.prefill(prompt), 10), "ms")
    if hf is not None:
        ids = torch.tensor(prompt, device="cuda")
        hf_ms = timed(lambda: hf(ids, logits_to_keep=1).logits.argmax(-1).item(), 10)
        report("HF TTFT 2048", hf_ms, "ms")
    many = random_prompts(16, 512, 2)
    report("pdkv 16x512 prefill together", timed(lambda: pd.prefill(many), 10), "ms")
    same_total = random_prompts(16, 128, 2)
    report("pdkv 16x128 prefill together", timed(lambda: pd.prefill(same_total), 10), "ms")


def pdkv_step_ms(pd: Pdkv, b: int) -> float:
    pd.prefill(random_prompts(b, 512, 3))
    rows = np.arange(b)
    pos = np.full(b, 512, dtype=np.int64)

    def one() -> None:
        pos[:] += 1
        pd.step(rows, [5] * b, pos)

    return timed(one, 50, warm=3)


def hf_step_ms(hf, b: int) -> float:
    import transformers

    cache = transformers.DynamicCache()
    ids = torch.tensor(random_prompts(b, 512, 3), device="cuda")
    state = [hf(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)]

    def one() -> None:
        out = hf(state[0], past_key_values=cache, use_cache=True, logits_to_keep=1)
        state[0] = out.logits.argmax(-1)
        state[0].tolist()

    return timed(one, 20)


def eager_step_ms(pd: Pdkv, b: int, kernels: bool) -> float:
    """`decode_step` without graphs: Triton kernels launched one by one, or the torch path."""
    pd.prefill(random_prompts(b, 512, 3))
    tables = torch.from_numpy(pd.tables[:b]).cuda()
    pos = torch.full((b,), 600, device="cuda")
    slots = tables[torch.arange(b, device="cuda"), pos // BLOCK] * BLOCK + pos % BLOCK
    args = (torch.full((b,), 5, device="cuda"), pos, slots, tables, pos + 1, pd.kv)
    pd.model.use_kernels = kernels
    try:
        return timed(lambda: pd.model.decode_step(*args).argmax(-1).tolist(), 10)
    finally:
        pd.model.use_kernels = True


def bench_steps(pd: Pdkv, hf) -> None:
    for b in (1, 16, 64):
        report(f"pdkv decode step b={b} ctx~512", pdkv_step_ms(pd, b), "ms")
        if hf is not None:
            report(f"HF decode step b={b} ctx~512", hf_step_ms(hf, b), "ms")
    report("pdkv decode step b=16, kernels without graphs", eager_step_ms(pd, 16, True), "ms")
    report("pdkv decode step b=16, torch path (before)", eager_step_ms(pd, 16, False), "ms")


def bench_throughput(pd: Pdkv, hf, rows: int) -> None:
    prompts = random_prompts(16, 512, 4)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = pd.generate(prompts, [128] * 16)
    report("pdkv 16x(512+128) greedy", n / (time.perf_counter() - t0), "tok/s")
    if hf is not None:
        ids = torch.tensor(prompts, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen = dict(do_sample=False, max_new_tokens=128, min_new_tokens=128, pad_token_id=0)
        out = hf.generate(ids, **gen)
        torch.cuda.synchronize()
        n_hf = (out.shape[1] - 512) * out.shape[0]
        report("HF 16x(512+128) greedy", n_hf / (time.perf_counter() - t0), "tok/s")
    if rows < 256:  # nano-vllm's burst needs a row a sequence
        return

    rng = random.Random(0)
    lens = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(256)]
    prompts = [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(p)] for p, _ in lens]
    pd.generate(prompts[:8], [4] * 8)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = pd.generate(prompts, [o for _, o in lens])
    report("pdkv 256 seqs, lengths 100-1024", n / (time.perf_counter() - t0), "tok/s")
    # one process prefills all 256 first: every request's first token comes at this time (the
    # TTFT the daemons' p99 is held against, issue 24)
    report("pdkv 256 seqs, every TTFT (the prefill of all)", pd.last_prefill_s * 1e3, "ms")


def bench_floor(pd: Pdkv) -> None:
    w = pd.model.weights
    tensors = [w.norm, w.lm_head] + [
        t
        for lw in w.layers
        for t in (lw.input_norm, lw.qkv, lw.o, lw.post_norm, lw.gate_up, lw.down)
    ]
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), 20)
    bw = 2 * src.numel() / (ms / 1e3)  # bytes moved (read + write) per second
    report("device copy bandwidth (read+write)", bw / 1e9, "GB/s")
    kv_token = 2 * pd.kv.shape[1] * pd.kv.shape[4] * pd.kv.shape[5] * pd.kv.element_size()
    for b in (1, 16, 64):
        floor = (weight_bytes + b * 512 * kv_token) / bw * 1e3
        report(f"floor of a step b={b} ctx 512 (weights + KV at copy bandwidth)", floor, "ms")


def _kernel_table(fn: Callable[[], object], reps: int) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)


def profile(pd: Pdkv, path: Path) -> None:
    """Per-kernel device time of 5 eager batch-16 decode forwards (the graph replays these) and
    of 3 prefills of a 2048-token prompt."""
    from common.model.fastpath import decode_forward

    n = 16
    tables = torch.from_numpy(pd.tables[:n]).cuda()
    pos = torch.full((n,), 600, device="cuda")
    slots = tables[torch.arange(n, device="cuda"), pos // BLOCK] * BLOCK + pos % BLOCK
    args = (torch.full((n,), 5, device="cuda"), pos, slots, tables, pos + 1, pd.kv)
    decode = _kernel_table(lambda: decode_forward(pd.model, *args), 5)
    prompt = random_prompts(1, 2048, 1)
    prefill = _kernel_table(lambda: pd.prefill(prompt), 3)
    text = f"decode b=16, 5 forwards\n{decode}\nprefill 2048, 3 forwards\n{prefill}"
    path.write_text(text)
    print(text, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("engine_results.json"))
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument(
        "--save-checkpoint",
        type=Path,
        metavar="DIR",
        help="write the random checkpoint here and keep it (e.g. for bench/serve.py --model DIR)",
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    ap.add_argument("--rows", type=int, default=None, help="pool rows (default 256, 64 at 8B)")
    ap.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure HF transformers too (default: at the 1.1B shape only)",
    )
    args = ap.parse_args()
    small = args.shape == "tinyllama-1.1b"
    rows = args.rows or (256 if small else 64)
    with_hf = small if args.hf is None else args.hf
    SHAPE.clear()
    SHAPE.update(SHAPES[args.shape][2])
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        ckpt = args.save_checkpoint or Path(tmp)
        t0 = time.perf_counter()
        hf = build_checkpoint(ckpt, args.shape)
        report("build + save checkpoint", time.perf_counter() - t0, "s")
        if not with_hf:
            del hf  # its weights leave the GPU before pdkv loads its own
            hf = None
            torch.cuda.empty_cache()
        pd = Pdkv(ckpt, rows)
        bench_floor(pd)
        bench_prefill(pd, hf)
        bench_steps(pd, hf)
        bench_throughput(pd, hf, rows)
        if args.profile:
            profile(pd, args.profile)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "shape": args.shape}
    args.out.write_text(json.dumps({"meta": meta, "results": RESULTS}, indent=1))


if __name__ == "__main__":
    main()
