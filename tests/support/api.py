"""Real daemons and a real API server process for the HTTP tests, driven with the `openai` package;
the API's /metrics as samples."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from common import client
from tests.support.daemons import Pair, short_dir

openai = pytest.importorskip("openai")

MODEL = "pdkv-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ApiProc:
    proc: subprocess.Popen
    port: int
    log: Path
    api_key: str = "unused"
    _client: openai.OpenAI | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def sync_client(self) -> openai.OpenAI:
        """One client per API process, closed by stop() (an unclosed one leaks its socket)."""
        if self._client is None:
            self._client = openai.OpenAI(
                base_url=self.url + "/v1", api_key=self.api_key, max_retries=0
            )
        return self._client

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=self.api_key, max_retries=0, **kw
        )

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        """GET `path`: (status, headers, body), also for error statuses."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()

    def stop(self) -> int:
        if self._client is not None:
            self._client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


def start_api(runtime: Path, *args: str, api_key: str | None = None) -> ApiProc:
    """`pdkv api start` in the foreground as a child process; returns once /v1/models answers."""
    port = free_port()
    log = runtime / f"api-{port}.log"
    env = {k: v for k, v in os.environ.items() if k != "PDKV_API_KEY"}
    if api_key:
        env["PDKV_API_KEY"] = api_key
    argv = [
        sys.executable,
        "-m",
        "pdkv.cli",
        "--runtime-dir",
        str(runtime),
        "--log-format",
        "json",
        "api",
        "start",
        "--port",
        str(port),
        *args,
    ]
    with open(log, "ab") as fh:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, env=env)
    api = ApiProc(proc, port, log, api_key or "unused")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"api exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return api
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"api not listening in 60 s:\n{log.read_text()[-3000:]}")


@dataclass
class Stack:
    pair: Pair
    api: ApiProc

    def statuses(self) -> dict:
        return {
            role: asyncio.run(client.status(path, timeout=5))
            for role, path in (
                ("prefill", self.pair.client_socket),
                ("decode", self.pair.link_socket),
            )
        }

    def wait_idle(self, timeout: float = 20) -> dict:
        """Poll until both daemons hold no request and every block is free; the last statuses."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.statuses()
            idle = all(s.inflight == 0 and s.pool["free"] == s.pool["total"] for s in st.values())
            if idle or time.monotonic() > deadline:
                return st
            time.sleep(0.05)


def short_runtime(factory: pytest.TempPathFactory) -> Path:
    return short_dir(factory, "api")


@contextlib.contextmanager
def running_stack(
    factory: pytest.TempPathFactory, *prefill_args: str, api_key: str | None = None
) -> Iterator[Stack]:
    """decode + prefill (with `prefill_args`) + the API, in a fresh runtime dir."""
    pair = Pair(short_runtime(factory))
    try:
        pair.start("decode")
        pair.start("prefill", *prefill_args)
        api = start_api(pair.runtime, api_key=api_key)
        yield Stack(pair, api)
        assert api.stop() == 0
    finally:
        pair.kill_all()


def samples(stack: Stack) -> list[Sample]:
    """Every sample of the API's /metrics; each one names its process (`pdkv_instance`)."""
    status, _, body = stack.api.get("/metrics")
    assert status == 200
    out = [s for family in text_string_to_metric_families(body.decode()) for s in family.samples]
    assert all(s.labels.get("pdkv_instance") for s in out), [s for s in out if not s.labels]
    return out


def metrics(stack: Stack) -> dict[str, float]:
    """name{label=value,...} → value, the labels but `pdkv_instance` (samples() checks it)."""
    out = {}
    for s in samples(stack):
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "pdkv_instance")
        out[f"{s.name}{{{labels}}}"] = s.value
    return out
