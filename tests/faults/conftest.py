"""Fault-injection fixtures: real daemon processes (tests.integration's Pair), fake peers, polling.

Everything waits by polling with a generous bound (no timed assertions): a condition that never
comes true fails with the last value seen, a hung client fails through its own timeout.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from common import client
from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from common.protocol import StatusReply
from tests.integration.conftest import Daemon, Pair, wait_ready

T = TypeVar("T")
BLOCK = 16

__all__ = ["BLOCK", "Daemon", "FaultPair", "all_free", "new_pair", "poll", "pool_of", "status"]


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


def poll(fn: Callable[[], T], *, timeout: float = 30.0, every: float = 0.05, what: str = "") -> T:
    """Call fn until it returns something truthy; AssertionError with the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (OSError, TimeoutError) as exc:
            last = exc
        if last and not isinstance(last, BaseException):
            return last  # type: ignore[return-value]
        time.sleep(every)
    raise AssertionError(f"not reached within {timeout}s: {what or fn} (last: {last!r})")


def assert_pair_free(pair: Pair) -> None:
    """Both allocators report every block free (polled: RELEASEs and frees may be in flight)."""
    for role, d in pair.daemons.items():
        if d.proc.poll() is None:
            sock = str(d.socket)
            poll(lambda s=sock: all_free(s), timeout=15, what=f"{role} pool all free")


@pytest.fixture(scope="session")
def tiny_model():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = load_model(None)
    yield model, tok
    torch.set_num_threads(before)


@pytest.fixture
def expect(tiny_model) -> Callable[[list[int], SamplingParams], list[int]]:
    """The single-process reference's tokens for (prompt, params)."""
    model, _ = tiny_model

    def run(prompt: list[int], params: SamplingParams) -> list[int]:
        return reference.generate(model, prompt, params, block_size=BLOCK)

    return run


def new_pair(tmp_path_factory: pytest.TempPathFactory, name: str) -> FaultPair:
    """A FaultPair on a fresh 0700 runtime dir (no daemon started yet)."""
    path = Path(tmp_path_factory.mktemp(name, numbered=True))
    os.chmod(path, 0o700)
    return FaultPair(path)


@pytest.fixture
def fault_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultPair]:
    pair = new_pair(tmp_path_factory, "ft")
    yield pair
    pair.kill_all()
