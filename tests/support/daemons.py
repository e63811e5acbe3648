"""Real daemon processes on real Unix sockets, started through the CLI module (Pair, Daemon), and
what the tests ask them (STATUS, pools all free)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common import client
from common.protocol import StatusReply
from tests.support.wait import poll

#: the daemons' default block size
BLOCK = 16


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


class FaultPair(Pair):
    """A Pair whose logs may live outside the runtime dir and whose sockets may be moved."""

    def __init__(self, runtime: Path, log_dir: Path | None = None) -> None:
        super().__init__(runtime, log_dir=log_dir)

    def socket_of(self, role: str) -> str:
        return self.client_socket if role == "prefill" else self.link_socket

    def start_both(self) -> None:
        """Start decode and prefill at once (the prefill's link retries until decode is up)."""
        d = self.start("decode", wait=False)
        p = self.start("prefill", wait=False)
        wait_ready(d)
        wait_ready(p, linked=True)

    def kill(self, role: str) -> None:
        d = self.daemons[role]
        d.proc.kill()
        d.proc.wait(timeout=10)


def status(sock: str) -> StatusReply:
    return asyncio.run(client.status(sock, timeout=5))


def pool_of(sock: str) -> dict[str, int]:
    return status(sock).pool


def all_free(sock: str) -> bool:
    pool = pool_of(sock)
    return pool["free"] == pool["total"] and pool["owned"] == 0 and pool["leased"] == 0


def assert_pair_free(pair: Pair) -> None:
    """Both allocators report every block free (polled: RELEASEs and frees may be in flight)."""
    for role, d in pair.daemons.items():
        if d.proc.poll() is None:
            sock = str(d.socket)
            poll(lambda s=sock: all_free(s), timeout=15, what=f"{role} pool all free")


def short_dir(factory: pytest.TempPathFactory, name: str = "rt") -> Path:
    """A fresh 0700 runtime dir, its path short: AF_UNIX paths are limited to 108 bytes."""
    path = Path(factory.mktemp(name, numbered=True))
    os.chmod(path, 0o700)
    return path


def new_pair(tmp_path_factory: pytest.TempPathFactory, name: str) -> FaultPair:
    """A FaultPair on a fresh 0700 runtime dir (no daemon started yet)."""
    return FaultPair(short_dir(tmp_path_factory, name))
