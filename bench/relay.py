"""The prefill's per-token relay to a client, without the daemons: CPU µs per token.

For each tokenizer (the tiny model's bytes; SmolLM2's tokenizer.json when `pdkv.models` has made
it, or `--tokenizer DIR`), one request's generation of `--tokens` ids (text with multi-byte UTF-8
characters: accents, CJK, emoji) goes through what the prefill does per TOKENS frame from the
decode: `RequestOutput.tokens` (the text delta) and the frame's encoding; then the whole relay
through a real socket pair: `--requests` streams of frames of one token each written by the
prefill's client-side writer (`prefill_server.client_writer`) and read by a client. Median of
`--repeat` runs.

`--daemons N`: instead, a real pair (tiny model, CPU) serves N requests at once, 64 tokens each,
text streamed (as the API asks), `--repeat` times; the figure is the prefill daemon's own CPU time
(utime + stime from /proc) per output token, which other jobs on a shared machine do not inflate
the way they inflate wall-clock throughput.

    .venv/bin/python bench/relay.py [--tokens 512] [--requests 64] [--repeat 5]
    .venv/bin/python bench/relay.py --daemons 64 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.daemon import logs  # noqa: E402
from common.model.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402
from common.protocol import Message, encode  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from common.wire.channel import FrameChannel  # noqa: E402
from prefill_server.output import RequestOutput  # noqa: E402
from prefill_server.request import PrefillRequest  # noqa: E402

TEXT = (
    "Paged attention stores the KV cache in blocks — naïve café, Größe, 東京の天気は晴れ, "
    "emoji 🚀🧪👩‍🔬 and numbers 3.14159; "
)


def tokenizers(extra: str | None) -> dict[str, object]:
    out: dict[str, object] = {"bytes": ByteTokenizer()}
    paths = [Path(extra)] if extra else []
    try:
        from pdkv import models

        paths.append(models.cache_root() / models.DEFAULT_MODEL)
    except Exception:
        pass
    for path in paths:
        if (path / "tokenizer.json").is_file():
            out[path.name] = HFTokenizer(
                path / "tokenizer.json", bos_token_id=None, eos_token_id=None
            )
            break
    return out


def ids_of(tok: object, n: int) -> list[int]:
    text = TEXT
    while True:
        ids = [i for i in tok.encode(text) if i != tok.bos_token_id]  # type: ignore[attr-defined]
        if len(ids) >= n:
            return ids[:n]
        text += TEXT


def per_token_us(tok: object, ids: list[int]) -> float:
    """CPU µs per token of the text delta and the TOKENS frame's encoding."""
    out = RequestOutput(tok)
    req = PrefillRequest("bench", [1], SamplingParams(max_tokens=len(ids)))
    start = time.perf_counter()
    for t in ids:
        req.generated.append(t)
        encode(out.tokens(req, [t]))
    out.finish(req, "length", {})
    return (time.perf_counter() - start) / len(ids) * 1e6


async def socket_relay_us(requests: int, tokens: int, mode: str) -> float:
    """µs per frame: `requests` tasks each relaying `tokens` one-token TOKENS frames (woken
    together, as a decode step's frames wake them) to one client socket, read by a client.
    `mode` direct: each frame sent on its own under a write timeout (the relay before the
    client writer); writer: through `prefill_server.client_writer.ClientWriter`."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    server = FrameChannel(a, max_fds=0)
    reader = FrameChannel(b, max_fds=0)
    send = _direct(server) if mode == "direct" else _writer(server)
    out = RequestOutput(ByteTokenizer())
    steps = [asyncio.Event() for _ in range(tokens)]
    total = requests * tokens

    async def relay(i: int) -> None:
        req = PrefillRequest(f"r{i}", [1], SamplingParams(max_tokens=tokens))
        for step in steps:
            await step.wait()
            req.generated.append(65 + i % 26)
            await send(out.tokens(req, [req.generated[-1]]))

    async def read() -> None:
        for _ in range(total):
            await reader.recv()

    start = time.perf_counter()
    tasks = [asyncio.create_task(relay(i)) for i in range(requests)]
    client = asyncio.create_task(read())
    for step in steps:
        step.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks, client)
    elapsed = time.perf_counter() - start
    server.close()
    reader.close()
    return elapsed / total * 1e6


def _direct(channel: FrameChannel):  # type: ignore[no-untyped-def]
    async def send(msg: Message) -> None:
        async with asyncio.timeout(30.0):
            await channel.send(msg)

    return send


def _writer(channel: FrameChannel):  # type: ignore[no-untyped-def]
    from prefill_server.client_writer import ClientWriter

    return ClientWriter(channel, write_timeout_s=30.0).send


def prefill_cpu_us_per_token(requests: int, repeat: int) -> list[float]:
    """The prefill daemon's CPU µs per output token over `repeat` bursts of `requests`."""
    sys.path.insert(0, str(ROOT / "bench"))
    import serve_load as load
    from serve_daemons import daemon_stream, own_pair, process_cpu_s

    out = []
    opts = ["--device", "cpu", "--num-blocks", "2048"]
    with own_pair(opts, ["--max-batch", str(requests)]) as sock:
        pid = int((Path(sock).parent / "prefill.pid").read_text().split()[0])
        specs = load.make_workload(requests, float("inf"), (16, 64), (64, 64), 256, 0)

        def stream(s: load.RequestSpec):  # type: ignore[no-untyped-def]
            return daemon_stream(sock, s.prompt, s.output_len, text=True)

        asyncio.run(load.run_load(specs[:4], stream, label="warm-up", progress_s=1e9))
        for _ in range(repeat):
            before = process_cpu_s(pid)
            records, _ = asyncio.run(load.run_load(specs, stream, label="burst", progress_s=1e9))
            tokens = sum(r.output_tokens for r in records)
            out.append((process_cpu_s(pid) - before) / tokens * 1e6)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokenizer", metavar="DIR", help="a checkpoint dir with tokenizer.json")
    ap.add_argument("--daemons", type=int, metavar="N", help="a real pair, N requests at once")
    args = ap.parse_args()
    logs.configure("console", "WARNING")
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"relay bench: {platform.node()}, {platform.machine()}, {date}")
    if args.daemons:
        runs = prefill_cpu_us_per_token(args.daemons, args.repeat)
        print(
            f"  prefill daemon CPU per output token, {args.daemons} at once, text streamed: "
            f"median {statistics.median(runs):.1f} µs ({', '.join(f'{r:.1f}' for r in runs)})"
        )
        return 0
    for name, tok in tokenizers(args.tokenizer).items():
        ids = ids_of(tok, args.tokens)
        runs = [per_token_us(tok, ids) for _ in range(args.repeat)]
        print(f"  text delta + encode, {name:>24}: {statistics.median(runs):7.2f} µs/token")
    for mode in ("direct", "writer"):
        try:
            runs = [
                asyncio.run(socket_relay_us(args.requests, args.tokens // 8, mode))
                for _ in range(args.repeat)
            ]
        except ImportError as exc:
            print(f"  relay through a socket, {mode}: skipped ({exc})")
            continue
        print(
            f"  relay through a socket, {mode:>6}, {args.requests} streams: "
            f"{statistics.median(runs):7.2f} µs/frame"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
