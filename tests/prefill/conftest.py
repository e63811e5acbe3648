"""Real pairs for the prefill's batching tests, a burst client, the prefill's batch log lines,
and a prefill runtime for the RequestPipeline tests."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.daemon.runtime import ModelRuntime
from common.model.loader import load_model
from common.protocol import Error, Finish, Generate, Tokens, encode
from common.wire.channel import connect
from prefill_server.config import PrefillConfig
from prefill_server.startup import load_runtime
from tests.integration.conftest import Pair, runtime_dir

__all__ = [
    "BLOCK",
    "burst",
    "cfg_rt",
    "events",
    "new_pair",
    "prompts",
    "rt",
    "runtime_dir",
    "tiny",
]
BLOCK = 16


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    return load_model(None)


@pytest.fixture
def new_pair(runtime_dir) -> Iterator[Pair]:  # type: ignore[no-untyped-def]
    """A Pair with nothing started yet; whatever runs is killed at the end."""
    pair = Pair(runtime_dir)
    yield pair
    pair.kill_all()


async def burst(sock: str, gens: list[Generate]) -> dict[str, list[int] | Error]:
    """Send every GENERATE in one write on one connection, so all of them are in the daemon
    before its first forward returns; each request's tokens, or its ERROR."""
    channel = await connect(sock)
    try:
        await channel.send_bytes(b"".join(encode(g) for g in gens))
        out: dict[str, list[int] | Error] = {g.request_id: [] for g in gens}
        waiting = set(out)
        while waiting:
            msg = await asyncio.wait_for(channel.recv(), 120)
            if isinstance(msg, Tokens):
                out[msg.request_id].extend(msg.tokens)  # type: ignore[union-attr]
            elif isinstance(msg, Error):
                out[msg.request_id] = msg
                waiting.discard(msg.request_id)
            elif isinstance(msg, Finish):
                waiting.discard(msg.request_id)
        return out
    finally:
        channel.close()


def events(pair: Pair, name: str) -> list[dict]:
    """The prefill's JSON log lines of event `name`, in order."""
    lines = pair.daemons["prefill"].log_text().splitlines()
    parsed = [json.loads(line) for line in lines if line.startswith("{")]
    return [e for e in parsed if e.get("event") == name]


def prompts(n: int, lengths: list[int], seed: int = 3) -> list[list[int]]:
    """n prompts of random byte ids, their lengths cycling through `lengths`."""
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.fixture(scope="module")
def cfg_rt(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[PrefillConfig, ModelRuntime]]:
    """The tiny model's prefill runtime on CPU with a 16-block pool, for RequestPipeline tests."""
    yield from _runtime(tmp_path_factory, 16)


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelRuntime]:
    """The tiny model's prefill runtime on CPU with a 64-block pool, for the forward's tests."""
    for _, runtime in _runtime(tmp_path_factory, 64):
        yield runtime


def _runtime(
    tmp_path_factory: pytest.TempPathFactory, num_blocks: int
) -> Iterator[tuple[PrefillConfig, ModelRuntime]]:
    cfg = PrefillConfig(
        runtime_dir=Path(tmp_path_factory.mktemp("rt")), device="cpu", num_blocks=num_blocks
    )
    runtime = load_runtime(cfg)
    yield cfg, runtime
    runtime.close()
