"""What the HTTP layer adds over the raw socket client: TTFT and time per token, p50 and p99.

Starts a decode daemon, a prefill daemon and the API (the real CLI, CPU), then sends `--requests`
streamed greedy generations one after another, alternating between the raw socket client
(common.client.stream) and POST /v1/completions with stream=true (httpx, one kept-alive
connection, SSE lines parsed as a client would), so both see the same machine noise. Both
clocks stop at the same events: TTFT at the first non-empty text, the end at the last text
(FINISH / the finish_reason chunk); per token = (end − TTFT) / (tokens − 1).

    .venv/bin/python bench/api_overhead.py [--requests 300] [--max-tokens 32] [--out r.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from common import client
from common.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from serve_api import free_port
from serve_daemons import process_cpu_s

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def start(rt: Path, *argv: str) -> subprocess.Popen:
    log = open(rt / f"{argv[0]}.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(rt), "--log-format", "json"]
    return subprocess.Popen([*cmd, "--log-level", "WARNING", *argv], stdout=log, stderr=log)


async def wait_up(sock: str, url: str) -> None:
    for _ in range(1200):
        try:
            st = await client.status(sock, timeout=1)
            if st.links[0]["state"] == "up":
                async with httpx.AsyncClient() as http:
                    if (await http.get(url + "/health")).status_code == 200:
                        return
        except (OSError, TimeoutError, IndexError, client.PdkvError, httpx.HTTPError):
            pass
        await asyncio.sleep(0.05)
    raise SystemExit("the daemons or the API did not come up")


async def raw(sock: str, max_tokens: int) -> tuple[float, float]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first = end = 0.0
    async for msg in client.stream(sock, prompt=PROMPT, sampling=params):
        if msg.text:
            end = time.perf_counter()
            first = first or end
    return first - t0, (end - first) / (max_tokens - 1)


class Http:
    """A minimal HTTP/1.1 client on one kept-alive connection: POST, then the chunked SSE body.

    httpx costs ~7 ms a request on the loaded 2-core VM by itself (GET /v1/models: 7.5 ms with
    httpx, 0.2 ms with a plain socket), which would hide the server's cost; this measures the
    server with as little client as a client can be.
    """

    def __init__(self, port: int) -> None:
        self.port = port

    async def __aenter__(self) -> Http:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()

    async def stream(self, body: dict) -> AsyncIterator[dict]:
        data = json.dumps(body).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
        self.writer.write(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        status = await self.reader.readline()
        assert b" 200 " in status, status
        while (await self.reader.readline()) != b"\r\n":  # headers
            pass
        while size := int(await self.reader.readline(), 16):  # chunked body
            chunk = await self.reader.readexactly(size + 2)
            for line in chunk.split(b"\n"):
                if line.startswith(b"data: {"):
                    yield json.loads(line[6:])
        await self.reader.readline()


async def http(api: Http, max_tokens: int) -> tuple[float, float]:
    body = {
        "model": "pdkv-tiny",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    first = end = 0.0
    async for chunk in api.stream(body):
        choice = chunk["choices"][0]
        if choice["text"] or choice["finish_reason"]:
            end = time.perf_counter()
            first = first or end
    return first - t0, (end - first) / (max_tokens - 1)


async def measure(
    rt: Path, url: str, requests: int, warmup: int, max_tokens: int, api_pid: int
) -> dict:
    sock = str(rt / "prefill.sock")
    await wait_up(sock, url)
    got: dict[str, list[float]] = {
        k: [] for k in ("raw_ttft", "raw_tpot", "http_ttft", "http_tpot")
    }
    async with Http(int(url.rsplit(":", 1)[1])) as api:
        for _ in range(warmup):
            await raw(sock, max_tokens)
            await http(api, max_tokens)
        cpu0 = process_cpu_s(api_pid)
        for _ in range(requests):
            r = await raw(sock, max_tokens)
            h = await http(api, max_tokens)
            keys = ("raw_ttft", "raw_tpot", "http_ttft", "http_tpot")
            for key, v in zip(keys, (*r, *h), strict=True):
                got[key].append(v * 1e6)
        got["api_cpu_us_per_request"] = [(process_cpu_s(api_pid) - cpu0) / requests * 1e6]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rt = Path(tempfile.mkdtemp(prefix="pdkv-api-"))
    os.chmod(rt, 0o700)
    port = free_port()
    procs = [
        start(rt, "decode", "start", "--device", "cpu"),
        start(rt, "prefill", "start", "--device", "cpu"),
        start(rt, "api", "start", "--port", str(port)),
    ]
    try:
        got = asyncio.run(
            measure(
                rt,
                f"http://127.0.0.1:{port}",
                args.requests,
                args.warmup,
                args.max_tokens,
                procs[2].pid,
            )
        )
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(timeout=30)
    api_cpu = got.pop("api_cpu_us_per_request")[0]
    stats = {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in got.items()}
    res = {
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}",
        "date": time.strftime("%Y-%m-%d"),
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "results_us": stats,
        "api_cpu_us_per_request": api_cpu,
        "added_us": {
            f"{m}_{q}": stats[f"http_{m}"][q] - stats[f"raw_{m}"][q]
            for m in ("ttft", "tpot")
            for q in ("p50", "p99")
        },
    }
    print(
        f"HTTP API over the raw socket client, {res['machine']}, {res['date']}, "
        f"{args.requests} requests x {args.max_tokens} tokens"
    )
    for m, name in (("ttft", "TTFT"), ("tpot", "per token")):
        for q in ("p50", "p99"):
            r, h = stats[f"raw_{m}"][q], stats[f"http_{m}"][q]
            print(f"  {name:9} {q}: raw {r:9.1f} us   http {h:9.1f} us   added {h - r:8.1f} us")
    print(f"  API process CPU: {api_cpu:.0f} us per request ({args.max_tokens} tokens)")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
