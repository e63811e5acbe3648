"""Two APIs on different ports in one runtime dir (issue 25): each keeps its own pidfile, URL file
and log (api-PORT.*), both serve the same daemons, `pdkv status` lists both, `pdkv stop api
--port P` stops one and `pdkv stop` the rest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.api import MODEL, free_port, openai, short_runtime
from tests.support.daemons import Pair


def _cli(runtime: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(runtime), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _completion(url: str) -> str:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as api:
        out = api.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    return out.choices[0].text


def test_two_apis_share_a_runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    runtime = short_runtime(tmp_path_factory)
    pair = Pair(runtime)
    ports = sorted({free_port(), free_port()})
    assert len(ports) == 2
    try:
        pair.start("decode")
        pair.start("prefill")
        for port in ports:
            started = _cli(runtime, "api", "start", "--background", "--port", str(port))
            assert started.returncode == 0, started.stderr
            assert f"http://127.0.0.1:{port}/v1" in started.stdout
            assert (runtime / f"api-{port}.log").is_file()
        again = _cli(runtime, "api", "start", "--background", "--port", str(ports[0]))
        assert again.returncode == 3 and "already running on port" in again.stderr

        urls = [f"http://127.0.0.1:{p}" for p in ports]
        texts = [_completion(url) for url in urls]
        assert texts[0] == texts[1] and texts[0]  # one pair of daemons behind both

        status = _cli(runtime, "status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        apis = json.loads(status.stdout)["apis"]
        assert [(a["port"], a["url"]) for a in apis] == list(zip(ports, urls, strict=True))
        lines = _cli(runtime, "status").stdout.splitlines()
        assert lines[2:] == [f"api      up    pid {a['pid']}  {a['url']}/v1" for a in apis], lines

        one = _cli(runtime, "stop", "api", "--port", str(ports[0]))
        assert one.returncode == 0, one.stderr
        assert one.stdout == f"api (port {ports[0]}): stopped (pid {apis[0]['pid']})\n"
        assert _completion(urls[1]) == texts[1]  # the other one still serves
        left = json.loads(_cli(runtime, "status", "--json").stdout)["apis"]
        assert [a["port"] for a in left] == [ports[1]]

        rest = _cli(runtime, "stop")
        assert rest.returncode == 0, rest.stderr
        assert rest.stdout.splitlines()[0] == (
            f"api (port {ports[1]}): stopped (pid {apis[1]['pid']})"
        )
        assert not list(runtime.glob("api-*.pid")) and not list(runtime.glob("api-*.url"))
        assert [pair.daemons[r].proc.wait(timeout=30) for r in ("prefill", "decode")] == [0, 0]
    finally:
        for port in ports:
            _cli(runtime, "stop", "api", "--port", str(port))
        pair.kill_all()
