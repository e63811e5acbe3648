"""`pdkv status` over its runtime dir and `pdkv status DIR` judge by one rule: every daemon whose
socket is in the dir answers and each prefill there has a decode link up. A prefill whose decode
lives in another runtime dir (`--decode SOCK`, an XpYd deployment) is healthy both ways."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common import client
from tests.support.daemons import Pair, wait_ready


@pytest.fixture
def decode_elsewhere(
    runtime_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Pair, Pair]]:
    """A decode in a runtime dir of its own, and the prefill (in `runtime_dir`) linked to it."""
    other = Path(tmp_path_factory.mktemp("rtd", numbered=True))
    os.chmod(other, 0o700)
    decodes, prefills = Pair(other), Pair(runtime_dir)
    try:
        decode = decodes.start("decode")
        prefill = prefills.start("prefill", "--decode", str(decode.socket), wait=False)
        wait_ready(prefill, linked=True)
        yield decodes, prefills
    finally:
        prefills.kill_all()
        decodes.kill_all()


def _pdkv(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdkv.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_both_invocations_agree_on_a_prefill_with_its_decode_elsewhere(
    decode_elsewhere: tuple[Pair, Pair],
) -> None:
    decodes, prefills = decode_elsewhere
    rt = str(prefills.runtime)
    by_option, by_dir = _pdkv("--runtime-dir", rt, "status"), _pdkv("status", rt)
    assert by_dir.returncode == 0, by_dir.stdout + by_dir.stderr
    assert by_option.returncode == by_dir.returncode, by_option.stdout + by_option.stderr
    assert "link up" in by_option.stdout, by_option.stdout

    decodes.daemons["decode"].stop()  # the prefill's only decode: the link goes down
    deadline = time.monotonic() + 30
    while asyncio.run(client.status(prefills.client_socket)).links[0]["state"] == "up":
        assert time.monotonic() < deadline, "the link stayed up"
        time.sleep(0.05)
    by_option, by_dir = _pdkv("--runtime-dir", rt, "status"), _pdkv("status", rt)
    assert by_dir.returncode == by_option.returncode == 1, by_option.stdout + by_dir.stdout


def test_a_decode_no_prefill_is_linked_to_is_unhealthy_both_ways(
    decode_elsewhere: tuple[Pair, Pair],
) -> None:
    """The decode's own dir: healthy while the prefill (in another dir) is linked to it, not
    once that prefill is gone; in the prefill's usual dir this is a prefill still loading."""
    decodes, prefills = decode_elsewhere
    rt = str(decodes.runtime)
    by_option, by_dir = _pdkv("--runtime-dir", rt, "status"), _pdkv("status", rt)
    assert by_dir.returncode == by_option.returncode == 0, by_option.stdout + by_dir.stdout

    prefills.daemons["prefill"].stop()
    deadline = time.monotonic() + 30
    while asyncio.run(client.status(decodes.link_socket)).links:
        assert time.monotonic() < deadline, "the decode kept the prefill's link"
        time.sleep(0.05)
    by_option, by_dir = _pdkv("--runtime-dir", rt, "status"), _pdkv("status", rt)
    assert by_dir.returncode == by_option.returncode == 1, by_option.stdout + by_dir.stdout
