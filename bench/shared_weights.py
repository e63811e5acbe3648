"""One copy of the weights per host (issue 41 item 2): a pair's memory with --share-weights
against --no-share-weights, and its greedy tokens, same checkpoint, same run.

    python3 bench/shared_weights.py                                  # CPU: a 131 MB checkpoint
    python3 bench/shared_weights.py --device cuda:0 --shape tinyllama-1.1b
    python3 bench/shared_weights.py --device cuda:0 --shape llama3-8b   # 16 GB of bf16 weights

Each mode starts a decode, waits for it, then a prefill (so the decode owns the weights), runs
PROMPTS greedy, and measures: on CPU the pair's PSS (/proc/PID/smaps_rollup: a page shared by n
processes counts 1/n in each); on CUDA the GPU's used memory (nvidia-smi, the whole device: an
IPC mapping is not in the importer's per-process figure) and each daemon's per-process figure.
Prints one JSON line per mode and a markdown row; exits 1 if the tokens differ between modes.
The random checkpoint (bench/engine.py's shapes, built with transformers; on CPU a 256k-token
vocabulary at hidden 64) is written under --ckpt once and reused.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from serve_daemons import start_cli, stop_procs, temp_runtime_dir, wait_linked

from common import client
from common.sampling_params import SamplingParams

PROMPTS = [[1, *range(40, 60)], [1, 7, 250, 3, 99, 42], [1, *range(900, 1000)]]
NEW_TOKENS = 32
CPU_SHAPE = {
    "vocab_size": 256_000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def build(path: Path, shape: str, device: str) -> None:
    if (path / "config.json").exists():
        return
    import transformers

    if shape == "cpu-256k":
        cfg = transformers.LlamaConfig(**CPU_SHAPE, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
        return
    from engine import build_checkpoint

    build_checkpoint(path, shape)  # on cuda:0, bf16


def pss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def gpu_used() -> tuple[int, dict[int, int]]:
    """(the GPU's used bytes, per-process used bytes) from nvidia-smi (GPU 0)."""
    q = ["nvidia-smi", "--id=0", "--format=csv,noheader,nounits"]
    used = int(subprocess.check_output([*q, "--query-gpu=memory.used"], text=True).split()[0])
    apps = subprocess.check_output([*q, "--query-compute-apps=pid,used_memory"], text=True)
    procs = {}
    for line in apps.strip().splitlines():
        pid, mib = (int(x) for x in line.split(","))
        procs[pid] = mib * 2**20
    return used * 2**20, procs


def greedy(sock: str) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    async def run() -> list[client.Result]:
        return await asyncio.gather(
            *(client.generate(sock, prompt_tokens=p, sampling=params) for p in PROMPTS)
        )

    return [r.tokens for r in asyncio.run(run())]


def one_mode(ckpt: Path, device: str, share: bool, blocks: int) -> dict:
    rt = temp_runtime_dir()
    opts = ["--model", str(ckpt), "--allow-byte-tokenizer", "--device", device]
    opts += ["--num-blocks", str(blocks), "--share-weights" if share else "--no-share-weights"]
    decode = start_cli(rt, "decode", opts)
    procs = [decode]
    try:
        deadline = time.monotonic() + 600
        while not (rt / "decode.sock").exists():  # the decode listens once loaded: it owns
            if decode.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((rt / "decode.log").read_text()[-3000:])
            time.sleep(0.1)
        procs.append(start_cli(rt, "prefill", opts))
        asyncio.run(wait_linked(str(rt / "prefill.sock"), procs, timeout=600))
        tokens = greedy(str(rt / "prefill.sock"))
        out: dict = {"share": share, "device": device, "tokens": tokens}
        if device == "cpu":
            out["pair_pss_mib"] = round(sum(pss(p.pid) for p in procs) / 2**20, 1)
        else:
            used, per = gpu_used()
            out["gpu_used_mib"] = round(used / 2**20)
            out["per_process_mib"] = {
                role: round(per.get(p.pid, 0) / 2**20)
                for role, p in zip(("decode", "prefill"), procs, strict=True)
            }
        return out
    finally:
        stop_procs(list(reversed(procs)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default=None, help="cpu-256k (CPU default) or bench/engine.py's")
    ap.add_argument("--ckpt", type=Path, default=None)
    ap.add_argument("--num-blocks", type=int, default=256)
    args = ap.parse_args()
    shape = args.shape or ("cpu-256k" if args.device == "cpu" else "tinyllama-1.1b")
    ckpt = args.ckpt or Path(f"/tmp/pdkv-ckpt-{shape}")
    build(ckpt, shape, args.device)
    weights = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    on = one_mode(ckpt, args.device, True, args.num_blocks)
    off = one_mode(ckpt, args.device, False, args.num_blocks)
    same = on.pop("tokens") == off.pop("tokens")
    for r in (on, off):
        print(json.dumps({**r, "shape": shape, "weights_mib": round(weights / 2**20)}))
    key = "pair_pss_mib" if args.device == "cpu" else "gpu_used_mib"
    name = "CPU" if args.device == "cpu" else torch.cuda.get_device_name(0)
    print(
        f"| {shape}, {name} | weights {weights / 2**20:.0f} MiB | pair {key}: shared "
        f"{on[key]}, unshared {off[key]}, saved {off[key] - on[key]:.0f} | greedy tokens "
        f"{'equal' if same else 'DIFFER'} | {time.strftime('%Y-%m-%d')} |"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
