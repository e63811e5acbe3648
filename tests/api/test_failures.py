"""What the API answers when the daemons cannot: back-pressure (429), no daemon or no link
(503), a daemon that stops answering (504), a missing API key (401), and /health's reasons."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.api import (
    MODEL,
    Stack,
    free_port,
    openai,
    running_stack,
    short_runtime,
    start_api,
)
from tests.support.daemons import Pair


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A prefill that holds one request at a time (--max-pending 1); the API wants a key."""
    with running_stack(tmp_path_factory, "--max-pending", "1", api_key="s3cret") as s:
        yield s


def test_no_capacity_is_429_with_retry_after_and_the_holder_frees_on_disconnect(
    tight: Stack,
) -> None:
    api = tight.api.sync_client()
    holder = api.completions.create(
        model=MODEL,
        prompt="hold",
        max_tokens=4000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(holder))
    with pytest.raises(openai.RateLimitError) as info:
        api.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.body["code"] == "no_capacity"
    holder.close()
    st = tight.wait_idle()
    assert all(s.pool["free"] == s.pool["total"] and s.inflight == 0 for s in st.values())
    assert (
        api.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
    )


def test_api_key_is_required_and_checked(tight: Stack) -> None:
    with openai.OpenAI(base_url=tight.api.url + "/v1", api_key="wrong", max_retries=0) as no_key:
        with pytest.raises(openai.AuthenticationError):
            no_key.models.list()
        with pytest.raises(openai.AuthenticationError):
            no_key.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert [m.id for m in tight.api.sync_client().models.list()] == [MODEL]
    assert tight.api.get("/health")[0] == 200  # probes need no key


def test_health_is_503_with_the_reason_when_a_daemon_is_down(tight: Stack) -> None:
    tight.pair.daemons["decode"].stop()
    status, headers, body = tight.api.get("/health")
    assert status == 503 and headers["retry-after"] == "1"
    assert b"decode daemon" in body
    status, _, body = tight.api.get("/metrics")
    # a daemon that stopped answering keeps the name it last reported (or the API's for it)
    down = rb'pdkv_daemon_up\{pdkv_instance="decode[^"]*",role="decode"\} 0\.0'
    assert status == 200 and re.search(down, body), body


def test_no_prefill_is_503_and_the_api_reconnects_when_it_comes_back(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    pair = Pair(short_runtime(tmp_path_factory))
    api = start_api(pair.runtime)
    try:
        with pytest.raises(openai.InternalServerError) as info:
            api.sync_client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "1"
        status, _, body = api.get("/health")
        assert status == 503 and b"prefill daemon" in body and b"decode daemon" in body
        pair.start("decode")
        for _ in range(2):  # first start, then a restart: the API's connection to it is stale
            pair.start("prefill")
            out = api.sync_client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert out.usage.completion_tokens == 2
            assert pair.daemons["prefill"].stop() == 0
    finally:
        assert api.stop() == 0
        pair.kill_all()


def _silent_listener(path: Path) -> socket.socket:
    """A Unix socket that accepts connections and reads, but never answers (a hung prefill)."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen()

    def serve() -> None:
        conns = []
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                break
            conns.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_a_daemon_that_does_not_answer_is_504(tmp_path_factory: pytest.TempPathFactory) -> None:
    runtime = short_runtime(tmp_path_factory)
    srv = _silent_listener(runtime / "hung.sock")
    api = start_api(
        runtime, "--client-socket", str(runtime / "hung.sock"), "--request-timeout", "0.5"
    )
    try:
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as info:
                api.sync_client().completions.create(
                    model=MODEL, prompt="hi", max_tokens=2, stream=stream
                )
            assert info.value.status_code == 504
            assert info.value.body["code"] == "timeout"
    finally:
        srv.close()
        assert api.stop() == 0


def test_non_loopback_address_without_key_is_refused(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdkv.cli",
            "--runtime-dir",
            str(tmp_path),
            "api",
            "start",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 3
    assert "--api-key" in out.stderr


def test_background_start_status_and_stop(tmp_path_factory: pytest.TempPathFactory) -> None:
    runtime = short_runtime(tmp_path_factory)
    port = free_port()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(runtime), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    started = cli("api", "start", "--background", "--port", str(port))
    assert started.returncode == 0, started.stderr
    assert f"http://127.0.0.1:{port}/v1" in started.stdout
    again = cli("api", "start", "--background", "--port", str(port))
    assert again.returncode == 3 and "already running" in again.stderr
    status = cli("status", "--json")
    [api] = json.loads(status.stdout)["apis"]
    assert api["port"] == port and api["url"] == f"http://127.0.0.1:{port}"
    assert status.returncode == 1  # the daemons are down; the API does not count
    stopped = cli("stop", "api")
    assert stopped.returncode == 0
    assert f"api (port {port}): stopped (pid {api['pid']})" in stopped.stdout
    assert not list(runtime.glob("api-*.pid"))
