"""Real daemon processes on real Unix sockets, started through the CLI module."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common import client


@dataclass
class Daemon:
    role: str
    proc: subprocess.Popen
    socket: Path
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Pair:
    runtime: Path
    extra: dict[str, list[str]] = field(default_factory=dict)
    log_dir: Path | None = None  # default: the runtime dir
    daemons: dict[str, Daemon] = field(default_factory=dict)

    @property
    def client_socket(self) -> str:
        return str(self.runtime / "prefill.sock")

    @property
    def link_socket(self) -> str:
        return str(self.runtime / "decode.sock")

    def start(
        self,
        role: str,
        *args: str,
        wait: bool = True,
        module: str = "pdkv.cli",
        env: dict[str, str] | None = None,
    ) -> Daemon:
        """Start `role` through the CLI (or `module`, a CLI wrapper) with `env` added."""
        argv = [
            sys.executable,
            "-m",
            module,
            "--runtime-dir",
            str(self.runtime),
            "--log-format",
            "json",
            role,
            "start",
            "--device",
            "cpu",
            *self.extra.get(role, []),
            *args,
        ]
        log = (self.log_dir or self.runtime) / f"{role}.log"
        with open(log, "ab") as fh:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=fh,
                env={**os.environ, **(env or {})},
            )
        sock = self.runtime / ("prefill.sock" if role == "prefill" else "decode.sock")
        d = Daemon(role, proc, sock, log)
        self.daemons[role] = d
        if wait:
            wait_ready(d, linked=(role == "prefill" and "decode" in self.daemons))
        return d

    def kill_all(self) -> None:
        """SIGKILL whatever still runs (fixture teardown)."""
        for d in self.daemons.values():
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait(timeout=10)

    def stop_all(self) -> dict[str, int]:
        codes = {}
        for role in ("prefill", "decode"):
            if role in self.daemons:
                codes[role] = self.daemons[role].stop()
        return codes


def wait_ready(d: Daemon, *, linked: bool = False, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            raise AssertionError(
                f"{d.role} exited with {d.proc.returncode}:\n{d.log_text()[-3000:]}"
            )
        try:
            st = asyncio.run(client.status(str(d.socket), timeout=1))
            if not linked or st.links[0]["state"] == "up":
                return
        except (OSError, TimeoutError, AssertionError):
            pass
        except Exception:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{d.role} not ready in {timeout}s:\n{d.log_text()[-3000:]}")


@pytest.fixture
def runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # AF_UNIX paths are limited to 108 bytes: keep the runtime dir short.
    path = Path(tmp_path_factory.mktemp("rt", numbered=True))
    os.chmod(path, 0o700)
    return path


@pytest.fixture
def pair_factory(runtime_dir: Path) -> Iterator[Pair]:
    pair = Pair(runtime_dir)
    yield pair
    pair.kill_all()


@pytest.fixture
def pair(pair_factory: Pair) -> Pair:
    pair_factory.start("decode")
    pair_factory.start("prefill")
    return pair_factory
