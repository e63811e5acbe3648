"""One prefill daemon linked to two decode daemons over TCP (`--decode tcp://…` twice), all real
processes on 127.0.0.1 with the KV moved by NIXL: each link has its own peer in the prefill's
NIXL producer, so requests reach both decodes with the reference's tokens, a decode SIGKILLed
under load leaves the other serving and the prefill's pool whole, and two addresses of one decode
daemon are one decode (the second link is refused, named in status).
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common import client
from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from common.protocol import ErrorCode
from tests.support.daemons import Daemon, Pair, all_free, status, wait_ready
from tests.support.wait import poll

BLOCK = 16
KEY = "7d1e4c2b9a8f6e5d4c3b2a1908f7e6d5c4b3a29180f7e6d5"


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model(None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TcpTrio:
    """Decodes A and B listening on 127.0.0.1 (a runtime dir each), a prefill in a third."""

    def __init__(self, root: Path, key: Path) -> None:
        self.pairs = {name: Pair(_rundir(root, name)) for name in ("a", "b", "p")}
        self.key = key
        self.addr: dict[str, str] = {}

    def decode(self, name: str) -> Daemon:
        self.addr[name] = f"tcp://127.0.0.1:{_free_port()}"
        args = ("--listen", self.addr[name], "--link-key-file", str(self.key))
        return self.pairs[name].start("decode", *args)

    def prefill(self, *decodes: str, transfer: str = "push") -> Daemon:
        args = [a for d in decodes for a in ("--decode", d)]
        args += ["--link-key-file", str(self.key), "--transfer", transfer]
        prefill = self.pairs["p"].start("prefill", *args, wait=False)
        wait_ready(prefill, linked=True)
        return prefill

    def kill_all(self) -> None:
        for pair in self.pairs.values():
            pair.kill_all()


def _rundir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TcpTrio]:
    root = Path(tmp_path_factory.mktemp("tcp", numbered=True))  # short: AF_UNIX paths ≤ 108
    key = root / "link.key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    t = TcpTrio(root, key)
    yield t
    t.kill_all()


def _links_up(prefill: Daemon, n: int) -> None:
    poll(
        lambda: sum(lk["state"] == "up" for lk in status(str(prefill.socket)).links) == n,
        what=f"{n} links up",
    )


def _prompts(n: int, seed: int) -> list[list[int]]:
    return [[(seed * i + j) % 256 for j in range(6 + 7 * i)] for i in range(n)]


async def _generate(sock: str, prompts: list[list[int]], params: SamplingParams) -> list:
    return await asyncio.gather(
        *(client.generate(sock, prompt_tokens=p, sampling=params, timeout=60) for p in prompts),
        return_exceptions=True,
    )


@pytest.mark.parametrize("transfer", ["push", "pull"])
def test_requests_reach_both_tcp_decodes_and_equal_the_reference(trio, tiny, transfer):
    model, _ = tiny
    a, b = trio.decode("a"), trio.decode("b")
    prefill = trio.prefill(trio.addr["a"], trio.addr["b"], transfer=transfer)
    _links_up(prefill, 2)
    prompts, params = _prompts(10, 7), SamplingParams(max_tokens=6, ignore_eos=True)
    results = asyncio.run(_generate(str(prefill.socket), prompts, params))
    for i, (res, p) in enumerate(zip(results, prompts, strict=True)):
        assert not isinstance(res, BaseException), f"request {i}: {res!r}"
        assert res.tokens == reference.generate(model, p, params, block_size=BLOCK), i
    served = [status(str(d.socket)).served for d in (a, b)]
    assert sum(served) == 10 and min(served) > 0, f"one decode got every request: {served}"
    named = [r.finish.decode.partition("@")[2] for r in results]  # link-N@tcp://…
    assert sorted(named.count(trio.addr[n]) for n in "ab") == sorted(served)
    for d in (a, b):
        (link,) = status(str(d.socket)).links
        assert link["transport"] == "tcp"
    for d in (prefill, a, b):
        poll(lambda d=d: all_free(str(d.socket)), timeout=15, what=f"{d.role} pool free")


def test_a_tcp_decode_killed_under_load_leaves_the_other_serving(trio, tiny):
    """SIGKILL decode A while requests stream over both links: each request completes with the
    reference's tokens or ends LINK_LOST, later ones all go to B, and the prefill's pool comes
    back with nothing leased (A's link's leases and NIXL peer let go)."""
    model, _ = tiny
    a, b = trio.decode("a"), trio.decode("b")
    prefill = trio.prefill(trio.addr["a"], trio.addr["b"])
    _links_up(prefill, 2)
    prompts, params = _prompts(12, 11), SamplingParams(max_tokens=40, ignore_eos=True)

    async def load_and_kill() -> list:
        load = asyncio.ensure_future(_generate(str(prefill.socket), prompts, params))
        while (await client.status(str(a.socket))).inflight == 0:  # A holds some: kill it
            await asyncio.sleep(0.01)
        a.stop(signal.SIGKILL)
        return await load

    results = asyncio.run(load_and_kill())
    lost = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(r, client.RequestFailed) and r.code == ErrorCode.LINK_LOST for r in lost)
    assert len(lost) < len(prompts), "decode B served none"
    for res, p in zip(results, prompts, strict=True):
        if not isinstance(res, BaseException):
            assert res.tokens == reference.generate(model, p, params, block_size=BLOCK)
    _links_up(prefill, 1)
    served_before = status(str(b.socket)).served
    after = asyncio.run(_generate(str(prefill.socket), prompts[:4], params))
    for res, p in zip(after, prompts[:4], strict=True):
        assert not isinstance(res, BaseException), f"after the kill: {res!r}"
        assert res.tokens == reference.generate(model, p, params, block_size=BLOCK)
        assert res.finish.decode.endswith("@" + trio.addr["b"])
    assert status(str(b.socket)).served == served_before + 4
    poll(lambda: all_free(str(prefill.socket)), timeout=15, what="the prefill's pool whole")
    (down,) = [lk for lk in status(str(prefill.socket)).links if lk["state"] != "up"]
    assert down["decode"] == trio.addr["a"] and down["last_error"]


def test_two_addresses_of_one_tcp_decode_are_one_decode(trio, tiny):
    """127.0.0.1 and localhost name one decode daemon: the producer refuses the second link
    (its decode's NIXL agent is another link's peer already) and status says why."""
    a = trio.decode("a")
    port = trio.addr["a"].rpartition(":")[2]
    other = f"tcp://localhost:{port}"
    prefill = trio.prefill(trio.addr["a"], other)
    refused = poll(
        lambda: [
            lk for lk in status(str(prefill.socket)).links if "linked already" in lk["last_error"]
        ],
        what="the second address of one decode refused",
    )
    assert len(refused) == 1
    (up,) = [lk for lk in status(str(prefill.socket)).links if lk["state"] == "up"]
    assert up["decode"] != refused[0]["decode"]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    (res,) = asyncio.run(_generate(str(prefill.socket), [[1, 2, 3, 4, 5]], params))
    assert not isinstance(res, BaseException), res
    assert res.tokens == reference.generate(tiny[0], [1, 2, 3, 4, 5], params, block_size=BLOCK)
    assert status(str(a.socket)).served == 1
