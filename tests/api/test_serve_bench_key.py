"""bench/serve.py against a running API that needs a key: --api-key is sent, and without it the
bench fails on the API's 401 instead of measuring nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.api import Stack, running_stack

SERVE = Path(__file__).resolve().parents[2] / "bench" / "serve.py"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory, api_key="k3y") as s:
        yield s


def serve(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(SERVE), "--target", "api", "--api-url", url, "--requests", "3"]
    argv += ["--rate", "50", "--warmup", "0", "--prompt-len", "3:8", "--output-len", "2:4"]
    argv += ["--device", "cpu", *extra]
    env = {k: v for k, v in os.environ.items() if k != "PDKV_API_KEY"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


def test_the_key_is_sent(keyed: Stack) -> None:
    proc = serve(keyed.api.url, "--api-key", "k3y")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "\napi " in proc.stdout, proc.stdout


def test_without_the_key_the_bench_fails(keyed: Stack) -> None:
    proc = serve(keyed.api.url)
    assert proc.returncode != 0
    assert "401" in proc.stdout + proc.stderr
