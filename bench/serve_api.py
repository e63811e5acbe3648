"""The api target of bench/serve.py: the same workload through the OpenAI-compatible HTTP API.

`own_api` starts `pdkv api start --port P` (P a free loopback port, found by binding port 0) in a
runtime dir, in front of a given prefill socket, waits until GET /v1/models answers, and stops it
at the end (SIGTERM, SIGKILL after a timeout). `api_stream` is one streamed POST /v1/completions
with the prompt as token ids, greedy, `ignore_eos`; it yields the text of each SSE chunk that
carries text, then a `Usage` with the completion token count of the usage chunk. httpx is imported
here only, so the other targets do not need it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import ssl
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from serve_daemons import PairFailed, start_cli, stop_procs
from serve_load import Chunk, Usage

_DONE = "[DONE]"


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every client: httpx builds one per client otherwise (~50 ms of CPU,
    which would land in the TTFT of each request), though the API is plain HTTP."""
    return ssl.create_default_context()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now: the one the kernel picks for a socket bound to port 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def auth(api_key: str | None) -> dict[str, str]:
    """The Authorization header for an API started with --api-key (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def model_id(url: str, timeout: float = 1.0, api_key: str | None = None) -> str:
    """The first model GET {url}/v1/models lists: the name completions must ask for."""
    req = urllib.request.Request(url.rstrip("/") + "/v1/models", headers=auth(api_key))
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["data"][0]["id"]


def _log_tail(rt: Path) -> str:
    """The end of the API's log, for an error message (the runtime dir may be removed next)."""
    with contextlib.suppress(OSError):
        return "--- api.log\n" + (rt / "api.log").read_text(errors="replace")[-1500:]
    return "(no api.log)"


@contextlib.contextmanager
def own_api(rt: Path, client_socket: str, timeout: float = 60, workers: int = 1) -> Iterator[str]:
    """Run an API server (`workers` processes) in `rt` (its log `rt/api.log`) fronting
    `client_socket`; yield its URL. PairFailed, with the log's tail, when it exits or does not
    answer within `timeout`."""
    url = f"http://127.0.0.1:{free_port()}"
    opts = ["--port", url.rsplit(":", 1)[1], "--client-socket", client_socket]
    opts += ["--workers", str(workers)]
    proc = start_cli(rt, "api", opts)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise PairFailed(f"the API exited with {proc.returncode}\n{_log_tail(rt)}")
            with contextlib.suppress(OSError):
                model_id(url)
                break
            if time.monotonic() > deadline:
                raise PairFailed(f"the API did not answer in {timeout:g} s\n{_log_tail(rt)}")
            time.sleep(0.05)
        yield url
    finally:
        stop_procs([proc])


async def api_stream(
    url: str,
    model: str,
    prompt: list[int],
    output_len: int,
    timeout: float = 600,
    api_key: str | None = None,
) -> AsyncIterator[Chunk]:
    """One greedy streamed completion of exactly `output_len` tokens on its own connection (as the
    daemons target opens one per request): the text of each chunk, then Usage. Raises
    RuntimeError on an HTTP error, an error event or a stream without usage."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    async with (
        httpx.AsyncClient(
            base_url=url, timeout=timeout, trust_env=False, verify=_tls(), headers=auth(api_key)
        ) as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: " + _DONE:
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            text = "".join(c.get("text", "") for c in event.get("choices", []))
            if text:
                yield text
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    yield Usage(usage)
