"""Serving benchmark in the shape of vLLM's benchmark_serving: the daemons (over their socket and
over the HTTP API) against one process.

Open-loop Poisson arrivals at `--rate` requests/s (inf: all at once), prompt and output lengths
drawn uniformly from `--prompt-len` / `--output-len` with `--seed`, random prompt token ids, EOS
ignored so every request produces its drawn number of tokens (greedy). Per request: TTFT (arrival
→ first token), inter-token latencies (ITL, between token frames) and end-to-end latency; per run
p50/p99 of each, request and output-token throughput.

Targets (`--target`, default both = daemons + local; all = daemons + api + local; served =
daemons + api; the same workload replayed on each, one target after the other):
  daemons  a decode + prefill pair of its own on temporary sockets (stopped and removed at the
           end), or running daemons given by --client-socket / --runtime-dir; the client is
           common.client, every TOKENS frame timestamped on arrival;
  api      the same pair through `pdkv api start` on a free loopback port (started and stopped by
           the bench), or a running API given by --api-url: streamed POST /v1/completions, every
           SSE chunk with text timestamped on arrival, the token count from the usage chunk; for
           an API of its own, also that process's CPU time per output token;
  local    one process, one engine thread doing continuous batching (bench/local_engine.py) on
           the same model, device and pool size.

`--sweep 1,2,4,8` runs every rate and plots p99 TTFT and p99 ITL against the rate (matplotlib, when
installed). With `--slo-ttft-ms` and `--slo-itl-ms` it also reports goodput (DistServe's measure,
bench/serve_goodput.py): per rate and target the share of requests whose TTFT and mean ITL both
meet the bounds, and per target the highest rate at which at least `--slo-attainment` of them
do, as a table and (matplotlib) a plot of attainment against the rate. `--json OUT` writes every figure, per request included. Warm-up requests run first on
each target and are not counted. Exit status 1 when any request failed.

    python bench/serve.py --requests 50 --rate 20
    python bench/serve.py --model ~/llama-1b --device cuda:0 --nano     # nano-vllm's shape
    python bench/serve.py --model ~/llama-1b --device cuda:0 --sweep 1,2,4,8,16 --json serve.json
    python bench/serve.py --model ~/llama-1b --device cuda:0 --sweep 2,4,8,16,32,64 \
        --slo-ttft-ms 200 --slo-itl-ms 25                                  # goodput, both targets

Workloads with repeats (bench/serve_workloads.py), for the prefix cache: `--shared-prefix N` (every
prompt starts with the same N tokens, then --prompt-len of its own), `--turns T` (conversations of
T turns, each re-sending the one before; the summary then has TTFT per turn). Target `cache` runs
the daemons with the prefix cache and a second pair without it (`--no-prefix-cache` on both
daemons) on the same workload; FINISH's `cached_tokens` is among each request's server timings,
and each daemons run reports the KV its decode pulled (blocks, MiB).

    python bench/serve.py --model ~/tinyllama --device cuda:0 --target cache --requests 200 \
        --rate 20 --shared-prefix 1536 --prompt-len 128:128
    python bench/serve.py --model ~/tinyllama --device cuda:0 --target cache --requests 64 \
        --rate 4 --turns 8 --prompt-len 200:200 --output-len 32:32

Target `tier` (bench/serve_tier.py, the host KV tier): `--requests` conversations of `--turns`
turns whose every turn re-sends the whole conversation with the model's own answers and a new
message (`--message-len`), through a pair with `--host-cache-gb` and one without; per turn TTFT
p50/p99 and the prefill's computed tokens, the tokens of both pairs compared.

    python bench/serve.py --target tier --turns 8 --requests 32 --prompt-len 128:128 \
        --message-len 32:32 --output-len 32:32 --num-blocks 288 --host-cache-gb 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repo's `common`, whatever the current directory

import serve_goodput as goodput  # noqa: E402
import serve_load as load  # noqa: E402
import serve_tier  # noqa: E402
import serve_workloads  # noqa: E402
from serve_api import api_stream, model_id, own_api  # noqa: E402
from serve_daemons import (  # noqa: E402
    PairFailed,
    daemon_stream,
    decode_pulled_blocks,
    kv_block_bytes,
    own_pair,
    pool_sizes,
    tcp_link,
    temp_runtime_dir,
    tree_cpu_s,
    wait_linked,
)
from serve_report import plot, print_table, same_output  # noqa: E402

from api_server.config import api_file  # noqa: E402
from common.daemon import logs  # noqa: E402
from common.daemon.pool_size import AUTO, parse_num_blocks  # noqa: E402

#: nano-vllm's bench.py: 256 sequences, input and output lengths drawn from 100..1024
NANO_REQUESTS, NANO_LEN = 256, (100, 1024)

TARGETS = {
    "daemons": ["daemons"],
    "api": ["api"],
    "local": ["local"],
    "both": ["daemons", "local"],
    "all": ["daemons", "api", "local"],
    "served": ["daemons", "api"],  # one pair, its socket then its HTTP API
    "cache": ["daemons", "daemons-no-cache"],  # the prefix cache on, then off, one workload
    "tier": ["tier"],  # real multi-turn conversations, the host KV tier on, then off (serve_tier)
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=50, help="requests per rate (default 50)")
    ap.add_argument(
        "--nano",
        action="store_true",
        help="nano-vllm's benchmark shape: 256 requests all at once, prompts and outputs of "
        "100-1024 tokens, --max-batch 256, a pool of at least 256 x 2048 tokens (overrides those)",
    )
    ap.add_argument("--rate", type=float, default=math.inf, help="requests/s; inf = all at once")
    ap.add_argument("--sweep", type=_rates, help="comma-separated rates, e.g. 1,2,4,8 (not --rate)")
    ap.add_argument("--prompt-len", type=load.parse_range, default=(16, 128), metavar="MIN:MAX")
    ap.add_argument("--output-len", type=load.parse_range, default=(8, 64), metavar="MIN:MAX")
    ap.add_argument(
        "--workload",
        type=_workload,
        metavar="INxOUT",
        help="fixed lengths, e.g. 2048x512 or 8192x512 (the 8B-class figures people compare): "
        "--prompt-len IN:IN and --output-len OUT:OUT",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="every prompt starts with N same tokens",
    )
    ap.add_argument(
        "--turns",
        type=int,
        default=1,
        metavar="T",
        help="conversations of T turns (default 1: none)",
    )
    ap.add_argument(
        "--message-len",
        type=load.parse_range,
        default=(32, 64),
        metavar="MIN:MAX",
        help="target tier: each later turn's new message (default 32:64)",
    )
    ap.add_argument(
        "--host-cache-gb", type=float, default=1.0, help="target tier: the tier's size (default 1)"
    )
    ap.add_argument("--target", choices=list(TARGETS), default="both", help="default both")
    ap.add_argument("--model", metavar="DIR", help="HF checkpoint dir; default: the tiny model")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda:N (every target)")
    ap.add_argument(
        "--decode-device", help="daemons target: the decode's device (two GPUs); default --device"
    )
    ap.add_argument("--dtype", help="default float32 on CPU, bfloat16 on CUDA (as the daemons)")
    ap.add_argument(
        "--num-blocks",
        type=_num_blocks,
        default=1024,
        help="KV pool blocks (every target), or auto: the daemons size their pools from the "
        "device's memory (--memory-fraction) and one process gets the decode's count",
    )
    ap.add_argument(
        "--memory-fraction",
        type=float,
        help="with --num-blocks auto: both daemons' --memory-fraction (default: theirs)",
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=64, help="most sequences per decode step")
    ap.add_argument(
        "--max-prefill-tokens",
        type=int,
        help="prompt tokens per prefill forward: the prefill daemon's option, and the local "
        "engine's prefill budget a step (default: each one's own, 8192 and 2048)",
    )
    ap.add_argument("--torch-threads", type=int, default=0, help="0: 1 for tiny, else torch's")
    ap.add_argument(
        "--connection",
        choices=["shared", "per-request"],
        default="shared",
        help="daemons target: every request on one connection to the prefill, as the API sends "
        "them (default), or each on a connection of its own (a connect in every TTFT; the "
        "bench's way before 2026-12-03)",
    )
    ap.add_argument(
        "--link",
        choices=["uds", "push", "pull"],
        default="uds",
        help="daemons target: the pair's link, a Unix socket (default) or TCP on 127.0.0.1 with "
        "NIXL push or pull (as across hosts)",
    )
    ap.add_argument("--client-socket", help="use the running prefill daemon on this socket")
    ap.add_argument("--runtime-dir", help="use the running daemons of this runtime dir")
    ap.add_argument("--api-url", help="api target: this running API (http://HOST:PORT)")
    ap.add_argument(
        "--api-workers", type=int, default=1, help="api target: our API's --workers (default 1)"
    )
    ap.add_argument(
        "--api-key",
        default=os.environ.get("PDKV_API_KEY"),
        help="bearer key for --api-url's API (default: $PDKV_API_KEY)",
    )
    ap.add_argument(
        "--text",
        action="store_true",
        help="daemons target: ask for each TOKENS frame's text (GENERATE's stream, as the API "
        "does), so the prefill detokenizes every token; default ids only",
    )
    ap.add_argument("--warmup", type=int, default=2, help="uncounted requests per target first")
    ap.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write every figure here")
    ap.add_argument("--plot", type=Path, default=Path("serve_sweep.png"), help="sweep's PNG")
    ap.add_argument("--slo-ttft-ms", type=float, help="goodput: a request's TTFT bound")
    ap.add_argument(
        "--slo-itl-ms", type=float, help="goodput: a request's mean inter-token latency bound"
    )
    ap.add_argument(
        "--slo-attainment",
        type=float,
        default=0.9,
        help="goodput: share of requests within both bounds a rate must reach (default 0.9)",
    )
    ap.add_argument(
        "--goodput-plot", type=Path, default=Path("serve_goodput.png"), help="goodput's PNG"
    )
    args = ap.parse_args(argv)
    args.shared = args.connection == "shared"
    if args.nano:
        if args.sweep:
            ap.error("--nano is one rate (all at once): not with --sweep")
        args.requests, args.rate = NANO_REQUESTS, math.inf
        args.prompt_len = args.output_len = NANO_LEN
        args.max_batch = NANO_REQUESTS
        need = NANO_REQUESTS * -(-2 * NANO_LEN[1] // args.block_size)
        if args.num_blocks != AUTO:
            args.num_blocks = max(args.num_blocks, need)
    if args.workload:
        if args.nano:
            ap.error("--workload and --nano each set the lengths: give one")
        args.prompt_len, args.output_len = ((n, n) for n in args.workload)
    names = TARGETS[args.target]
    ours = not (args.client_socket or args.runtime_dir) and args.target != "tier"
    ours = ours and ("daemons" in names or ("api" in names and not args.api_url))
    if args.num_blocks == AUTO and not ours:
        ap.error("--num-blocks auto sizes a pair the bench starts: not with this target or pair")
    if args.memory_fraction is not None and args.num_blocks != AUTO:
        ap.error("--memory-fraction goes with --num-blocks auto")
    if args.requests < 1 or args.rate <= 0:
        ap.error("--requests must be >= 1 and --rate > 0")
    if args.shared_prefix < 0 or args.turns < 1:
        ap.error("--shared-prefix must be >= 0 and --turns >= 1")
    if (args.slo_ttft_ms is None) != (args.slo_itl_ms is None):
        ap.error("goodput needs both --slo-ttft-ms and --slo-itl-ms")
    args.rates = args.sweep or [args.rate]
    return args


def _workload(text: str) -> tuple[int, int]:
    """'2048x512' -> (2048, 512): a prompt and an output length, each >= 1."""
    prompt, sep, output = text.lower().partition("x")
    if not sep or not prompt.isdigit() or not output.isdigit() or min(int(prompt), int(output)) < 1:
        raise argparse.ArgumentTypeError(f"workload {text!r} must be INxOUT, e.g. 2048x512")
    return int(prompt), int(output)


def _num_blocks(text: str) -> int | str:
    try:
        return parse_num_blocks(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError("rates must be > 0 (inf allowed)")
    return rates


def machine() -> str:
    desc = f"{platform.node()}, {os.cpu_count()} cores, {platform.machine()}"
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            desc += f", {torch.cuda.get_device_name()}"
    return desc


def resolve_device(name: str) -> str:
    """`auto` as the daemons read it: cuda:0 when CUDA works, else cpu."""
    import torch

    if name != "auto":
        return name
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def vocab_size(model: str | None) -> int:
    """Prompt ids are drawn below this: the byte range for the tiny model, else the vocab."""
    from common.model.config import BYTE_VOCAB
    from common.model.loader import read_config

    return BYTE_VOCAB if model is None else read_config(Path(model).expanduser()).vocab_size


def run_target(
    name: str,
    open_stream: load.OpenStream,
    args: argparse.Namespace,
    *,
    cpu_pid: int | None = None,
) -> list[dict]:
    """Warm up, then replay the workload of every rate on one target; one result per rate.
    `cpu_pid`: a server process (the API) whose CPU time per output token each rate's summary
    gets as `server_cpu_us_per_token` (utime + stime from /proc)."""
    vocab = vocab_size(args.model)
    warm = load.make_workload(
        args.warmup, math.inf, args.prompt_len, args.output_len, vocab, args.seed + 7919
    )
    for spec in warm:  # one after another: first-call costs, not load
        asyncio.run(load.run_load([spec], open_stream, label=f"{name} warm-up"))
    results = []
    for rate in args.rates:
        specs = workload(args, rate, vocab)
        label = f"{name} @ {rate:g}/s"
        print(f"  {label}: {len(specs)} requests", file=sys.stderr, flush=True)
        cpu0 = tree_cpu_s(cpu_pid) if cpu_pid else {}
        records, duration = asyncio.run(
            load.run_load(specs, open_stream, label=label, progress_s=args.progress)
        )
        summary = load.summarize(records, duration)
        if cpu_pid and summary["output_tokens"]:
            now = tree_cpu_s(cpu_pid)
            used = [now.get(p, t) - t for p, t in cpu0.items()]  # its workers included
            cpu = sum(used)
            summary["server_cpu_us_per_token"] = round(cpu / summary["output_tokens"] * 1e6, 2)
            # the busiest process's share of a core: one process past ~0.9 bounds the rate
            summary["server_cpu_share"] = round(max(used) / duration, 3) if duration else None
        results.append(
            {
                "target": name,
                "rate": rate,
                "summary": summary,
                "requests": [r.to_json() for r in records],
            }
        )
    return results


def workload(args: argparse.Namespace, rate: float, vocab: int) -> list[load.RequestSpec]:
    """The measured requests of one rate: drawn, then with a shared prefix and in turns. Each
    rate of a sweep draws its own prompts (seed + its index), so a pair with the prefix cache
    does not find a later rate's prompts cached from an earlier one (one process has no cache)."""
    seed = args.seed + 1009 * args.rates.index(rate)
    specs = load.make_workload(args.requests, rate, args.prompt_len, args.output_len, vocab, seed)
    if args.shared_prefix:
        specs = serve_workloads.shared_prefix(specs, args.shared_prefix, vocab, args.seed)
    if args.turns > 1:
        specs = serve_workloads.multi_turn(specs, args.turns, vocab, args.seed)
    return specs


def common_options(args: argparse.Namespace) -> list[str]:
    """Both daemons' options of a pair of our own."""
    common = ["--device", args.device, "--num-blocks", str(args.num_blocks)]
    if args.memory_fraction is not None:
        common += ["--memory-fraction", str(args.memory_fraction)]
    common += ["--block-size", str(args.block_size)]
    for opt, value in (("--model", args.model), ("--dtype", args.dtype)):
        if value:
            common += [opt, str(value)]
    if args.model:  # prompts are token ids: a checkpoint without tokenizer.json serves as well
        common += ["--allow-byte-tokenizer"]
    if args.torch_threads:
        common += ["--torch-threads", str(args.torch_threads)]
    return common


@contextlib.contextmanager
def daemons_socket(args: argparse.Namespace, *, cache: bool = True) -> Iterator[str]:
    """The prefill's client socket: the given running daemons, or a pair of our own."""
    if args.client_socket or args.runtime_dir:
        sock = args.client_socket or str(Path(args.runtime_dir) / "prefill.sock")
        asyncio.run(wait_linked(sock, [], timeout=10))
        yield sock
        return
    common = common_options(args)
    decode = ["--max-batch", str(args.max_batch)]
    if args.decode_device:  # the last --device on the command line wins
        decode += ["--device", args.decode_device]
    if not cache:  # neither daemon: the decode's own cache would otherwise still save pulls
        common += ["--no-prefix-cache"]
    prefill: list[str] = []
    if args.max_prefill_tokens:
        prefill += ["--max-prefill-tokens", str(args.max_prefill_tokens)]
    with contextlib.ExitStack() as stack:
        if args.link != "uds":  # "push" or "pull": a TCP link with that NIXL transfer
            tcp_decode, tcp_prefill = stack.enter_context(tcp_link(args.link))
            decode, prefill = decode + tcp_decode, prefill + tcp_prefill
        yield stack.enter_context(own_pair(common, decode, prefill))


@contextlib.contextmanager
def api_for(sock: str, args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """An API of our own in front of `sock`, its URL and pid: in our pair's runtime dir, or, for
    running daemons, in a temporary one (removed at the end) so that nothing is left in theirs."""
    own = not (args.client_socket or args.runtime_dir)
    rt = Path(sock).parent if own else temp_runtime_dir()
    try:
        with own_api(rt, sock, workers=args.api_workers) as url:
            port = int(url.rsplit(":", 1)[1])
            yield url, int(api_file(rt, port, "pid").read_text())
    finally:
        if not own:
            shutil.rmtree(rt, ignore_errors=True)


def run_served(args: argparse.Namespace, names: list[str]) -> list[dict]:
    """The daemons and api targets among `names`, on one pair (ours, or the running one)."""
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        if "daemons" in names or not args.api_url:
            t = time.perf_counter()
            sock = stack.enter_context(daemons_socket(args))
            print(f"  daemons up in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
            args.pools = pool_sizes(sock)
            print(f"  pools: {args.pools}", file=sys.stderr, flush=True)
        if "daemons" in names:
            runs += with_pulls(
                sock,
                args,
                lambda: run_target(
                    "daemons",
                    lambda s: daemon_stream(
                        sock, s.prompt, s.output_len, text=args.text, shared=args.shared
                    ),
                    args,
                ),
            )
        if "daemons-no-cache" in names:
            if args.client_socket or args.runtime_dir:
                raise PairFailed("target cache starts its own pairs: no --client-socket")
            with daemons_socket(args, cache=False) as plain:
                runs += with_pulls(
                    plain,
                    args,
                    lambda: run_target(
                        "daemons-no-cache",
                        lambda s: daemon_stream(
                            plain, s.prompt, s.output_len, text=args.text, shared=args.shared
                        ),
                        args,
                    ),
                )
        if "api" in names:
            url, pid = args.api_url, None
            if not url:
                url, pid = stack.enter_context(api_for(sock, args))
            try:
                model = model_id(url, timeout=10, api_key=args.api_key)
            except OSError as e:
                raise PairFailed(f"no API answering at {url}: {e}") from None
            runs += run_target(
                "api",
                lambda s: api_stream(url, model, s.prompt, s.output_len, api_key=args.api_key),
                args,
                cpu_pid=pid,
            )
    return runs


def with_pulls(sock: str, args: argparse.Namespace, run: Callable[[], list[dict]]) -> list[dict]:
    """`run()`'s results, each (of a single rate) with the KV its decodes pulled meanwhile:
    `pulled_blocks` and `pulled_mib` in its summary (warm-up included; with several rates, the
    sum over them on each)."""
    before = decode_pulled_blocks(sock)
    results = run()
    blocks = decode_pulled_blocks(sock) - before
    size = kv_block_bytes(args.model, args.dtype, args.device, args.block_size)
    for r in results:
        r["summary"]["pulled_blocks"] = blocks
        r["summary"]["pulled_mib"] = round(blocks * size / 2**20, 1)
    return results


def run_local(args: argparse.Namespace) -> list[dict]:
    import torch
    from local_engine import LocalEngine

    from common.model import load_model
    from common.sampling_params import SamplingParams

    device = resolve_device(args.device)
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    threads = args.torch_threads or (1 if args.model is None else 0)
    if threads:
        torch.set_num_threads(threads)
    t = time.perf_counter()
    model, _ = load_model(args.model, device=device, dtype=dtype, allow_byte_tokenizer=True)
    print(f"  local model loaded in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    budget = {"prefill_tokens": args.max_prefill_tokens} if args.max_prefill_tokens else {}
    args.pools = {**getattr(args, "pools", {}), "local": local_blocks(args)}
    engine = LocalEngine(
        model,
        num_blocks=args.pools["local"],
        block_size=args.block_size,
        max_batch=args.max_batch,
        **budget,
    )
    with engine:
        return run_target(
            "local",
            lambda s: engine.stream(s.prompt, SamplingParams(s.output_len, ignore_eos=True)),
            args,
        )


def local_blocks(args: argparse.Namespace) -> int:
    """One process's pool: --num-blocks, or under auto the decode's (it holds the running
    sequences' KV, as the one process's pool does: the same capacity on both sides)."""
    if args.num_blocks != AUTO:
        return args.num_blocks
    return args.pools["decode"]


def _json_rate(rate: float | None) -> float | str | None:
    """A rate as JSON takes it: inf (all at once) as "inf"."""
    return "inf" if rate is not None and math.isinf(rate) else rate


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs.configure("console", "WARNING")
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs: list[dict] = []
    if args.target == "tier":
        return run_tier(args, date)
    try:
        names = TARGETS[args.target]
        if "daemons" in names or "api" in names:
            runs += run_served(args, names)
        if "local" in names:
            runs += run_local(args)
    except PairFailed as e:
        print(f"the daemons or the API did not come up: {e}", file=sys.stderr)
        return 2
    header = {"machine": machine(), "date": date, "model": args.model or "tiny"}
    header |= {"device": resolve_device(args.device)}
    header |= {k: getattr(args, k) for k in ("requests", "seed", "max_batch", "max_prefill_tokens")}
    header |= {k: getattr(args, k) for k in ("num_blocks", "block_size", "warmup")}
    header |= {"pools": getattr(args, "pools", None), "memory_fraction": args.memory_fraction}
    header |= {"prompt_len": list(args.prompt_len), "output_len": list(args.output_len)}
    header |= {"shared_prefix": args.shared_prefix, "turns": args.turns}
    header |= {"connection": args.connection, "link": args.link}
    print(
        f"serve bench: {args.requests} requests per rate, prompt {args.prompt_len[0]}:"
        f"{args.prompt_len[1]}, output {args.output_len[0]}:{args.output_len[1]} tokens, "
        f"seed {args.seed}; model {header['model']}, device {header['device']}; "
        f"{header['machine']}; {date}"
    )
    print_table(runs)
    same_output(runs, tiny=args.model is None)
    if args.sweep and any(math.isfinite(r) for r in args.rates):
        plot(runs, args.plot)
    if args.slo_ttft_ms is not None:
        slo = (args.slo_ttft_ms, args.slo_itl_ms)
        goodput.add_goodput(runs, *slo)
        goodput.print_goodput(runs, *slo, args.slo_attainment)
        header |= {"slo": {"ttft_ms": slo[0], "itl_ms": slo[1], "share": args.slo_attainment}}
        header |= {
            "goodput_rate": {
                t: _json_rate(goodput.goodput_rate(runs, t, args.slo_attainment))
                for t in dict.fromkeys(r["target"] for r in runs)
            }
        }
        if args.sweep and any(math.isfinite(r) for r in args.rates):
            goodput.plot_goodput(runs, args.goodput_plot, *slo)
    if args.json:
        finite = [{**r, "rate": _json_rate(r["rate"])} for r in runs]
        args.json.write_text(json.dumps({**header, "runs": finite}, indent=1, allow_nan=False))
    return 1 if any(r["summary"]["failed"] for r in runs) else 0


def run_tier(args: argparse.Namespace, date: str) -> int:
    """--target tier (bench/serve_tier.py): its own table; --json gets both runs."""
    if args.turns < 2:
        print("--target tier needs --turns 2 or more", file=sys.stderr)
        return 2
    header = {"machine": machine(), "date": date, "model": args.model or "tiny"}
    header |= {"device": resolve_device(args.device), "conversations": args.requests}
    header |= {k: getattr(args, k) for k in ("turns", "num_blocks", "block_size", "host_cache_gb")}
    header |= {"prompt_len": list(args.prompt_len), "message_len": list(args.message_len)}
    header |= {"output_len": list(args.output_len), "rate": _json_rate(args.rate)}
    print(f"serve bench, target tier: {header}")
    try:
        runs = serve_tier.run(args, common_options(args), vocab_size(args.model))
    except PairFailed as e:
        print(f"the daemons did not come up: {e}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(json.dumps({**header, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
