"""A daemon raises its soft fd limit to fit --max-connections, within the hard limit."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

from common.daemon.server import FD_HEADROOM
from tests.support.daemons import Daemon, wait_ready


def soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no 'Max open files' line")


def start_decode(runtime: Path, soft: int, hard: int, *args: str) -> Daemon:
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(runtime)]
    argv += ["--log-format", "json", "decode", "start", "--device", "cpu", *args]
    log = runtime / "decode.log"
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=fh,
            stdin=subprocess.DEVNULL,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
        )
    d = Daemon("decode", proc, runtime / "decode.sock", log)
    wait_ready(d)
    return d


def test_soft_limit_raised_to_fit_max_connections(tmp_path: Path) -> None:
    d = start_decode(tmp_path, 256, 8192, "--max-connections", "2000")
    try:
        assert soft_nofile(d.proc.pid) == 2000 + FD_HEADROOM
        assert '"fd_limit_raised"' in d.log_text()
    finally:
        assert d.stop() == 0


def test_hard_limit_is_kept_and_the_shortfall_logged(tmp_path: Path) -> None:
    d = start_decode(tmp_path, 256, 512, "--max-connections", "1024")
    try:
        assert soft_nofile(d.proc.pid) == 512
        assert "fd_limit_below_max_connections" in d.log_text()
    finally:
        assert d.stop() == 0
