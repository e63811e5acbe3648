"""One prefill daemon linked to several decode daemons (`--decode` given once per decode), all
real processes on real Unix sockets: requests spread over the decodes and give the reference's
tokens, a decode that dies leaves the rest serving, a decode that cannot serve (another block
size) is refused and named while the others serve, and bad --decode lists are refused at start.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common import client
from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from common.protocol import ErrorCode
from tests.support.daemons import Pair, wait_ready

BLOCK = 16


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model(None)


def _dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    path = Path(tmp_path_factory.mktemp(name, numbered=True))  # short: AF_UNIX paths ≤ 108 bytes
    os.chmod(path, 0o700)
    return path


@pytest.fixture
def trio(tmp_path_factory: pytest.TempPathFactory):
    """Decodes A and B in runtime dirs of their own, the prefill (in a third) linked to both."""
    pairs = {name: Pair(_dir(tmp_path_factory, f"rt{name}")) for name in ("a", "b", "p")}
    yield pairs
    for pair in pairs.values():
        pair.kill_all()


def _start_prefill(pairs: dict[str, Pair], *decodes: str, wait: bool = True):  # type: ignore[no-untyped-def]
    args = [a for d in decodes for a in ("--decode", d)]
    prefill = pairs["p"].start("prefill", *args, wait=False)
    if wait:
        wait_ready(prefill, linked=True)
    return prefill


def _status(path: Path | str):  # type: ignore[no-untyped-def]
    return asyncio.run(client.status(str(path)))


def _until(cond, what: str, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(what)


def _run(socket: str, prompts: list[list[int]], params: list[SamplingParams]):  # type: ignore[no-untyped-def]
    async def all_of_them():  # type: ignore[no-untyped-def]
        return await asyncio.gather(
            *(
                client.generate(socket, prompt_tokens=p, sampling=s, request_id=f"r{i}")
                for i, (p, s) in enumerate(zip(prompts, params, strict=True))
            ),
            return_exceptions=True,
        )

    return asyncio.run(all_of_them())


def test_requests_spread_over_two_decodes_and_equal_the_reference(trio, tiny):
    model, _ = tiny
    a, b = trio["a"].start("decode"), trio["b"].start("decode")
    prefill = _start_prefill(trio, str(a.socket), str(b.socket))
    _until(lambda: all(lk["state"] == "up" for lk in _status(prefill.socket).links), "links up")
    prompts = [[(7 * i + j) % 256 for j in range(5 + 9 * i)] for i in range(12)]
    params = [SamplingParams(max_tokens=6 + i % 5, ignore_eos=True) for i in range(12)]
    results = _run(str(prefill.socket), prompts, params)
    for i, (res, p, s) in enumerate(zip(results, prompts, params, strict=True)):
        assert not isinstance(res, BaseException), f"request {i}: {res!r}"
        assert res.tokens == reference.generate(model, p, s, block_size=BLOCK), f"request {i}"
    served = [_status(d.socket).served for d in (a, b)]
    assert sum(served) == 12 and min(served) > 0, f"one decode got every request: {served}"
    # FINISH names the decode each request went to (v9): both appear, as the counts say
    named = [r.finish.decode.partition("@")[2] for r in results]
    assert sorted(set(named)) == sorted([str(a.socket), str(b.socket)])
    assert sorted(named.count(str(d.socket)) for d in (a, b)) == sorted(served)
    links = _status(prefill.socket).links
    assert sorted(lk["decode"] for lk in links) == sorted([str(a.socket), str(b.socket)])
    assert all(lk["requests"] == 0 for lk in links)  # every request ended: none counted
    for d in (prefill, a, b):
        st = _status(d.socket)
        assert st.pool["free"] == st.pool["total"], f"{d.role} leaked blocks"


def test_a_killed_decode_leaves_the_other_serving(trio, tiny):
    model, _ = tiny
    a, b = trio["a"].start("decode"), trio["b"].start("decode")
    prefill = _start_prefill(trio, str(a.socket), str(b.socket))
    _until(lambda: all(lk["state"] == "up" for lk in _status(prefill.socket).links), "links up")
    a.stop(signal.SIGKILL)
    _until(
        lambda: sum(lk["state"] == "up" for lk in _status(prefill.socket).links) == 1,
        "the prefill never saw decode A go",
    )
    prompts = [[(3 * i + j) % 256 for j in range(20 + i)] for i in range(6)]
    params = [SamplingParams(max_tokens=5, ignore_eos=True)] * 6
    results = _run(str(prefill.socket), prompts, params)
    for i, (res, p, s) in enumerate(zip(results, prompts, params, strict=True)):
        assert not isinstance(res, BaseException), f"request {i} after the kill: {res!r}"
        assert res.tokens == reference.generate(model, p, s, block_size=BLOCK)
    assert _status(b.socket).served == 6
    st = _status(prefill.socket)
    assert st.pool["free"] == st.pool["total"]
    (down,) = [lk for lk in st.links if lk["state"] != "up"]
    assert down["decode"] == str(a.socket) and down["last_error"]


def test_every_decode_down_fails_fast_with_link_lost(trio):
    a, b = trio["a"].start("decode"), trio["b"].start("decode")
    prefill = _start_prefill(trio, str(a.socket), str(b.socket))
    for d in (a, b):
        d.stop(signal.SIGKILL)
    _until(lambda: all(lk["state"] != "up" for lk in _status(prefill.socket).links), "links down")
    started = time.monotonic()
    (res,) = _run(str(prefill.socket), [[1, 2, 3]], [SamplingParams(max_tokens=4)])
    assert isinstance(res, client.RequestFailed) and res.code == ErrorCode.LINK_LOST, res
    assert time.monotonic() - started < 10  # not the 30 s handoff timeout
    assert str(a.socket) in res.reason and str(b.socket) in res.reason


def test_a_decode_with_another_block_size_is_refused_and_named_while_the_other_serves(trio, tiny):
    model, _ = tiny
    good = trio["a"].start("decode")
    odd = trio["b"].start("decode", "--block-size", "8")
    prefill = _start_prefill(trio, str(good.socket), str(odd.socket))
    _until(
        lambda: (
            "INCOMPATIBLE"
            in {lk["decode"]: lk for lk in _status(prefill.socket).links}[str(odd.socket)][
                "last_error"
            ]
        ),
        "the refused decode is not named with its reason",
    )
    prompts = [[5, 6, 7, 8] * (i + 1) for i in range(4)]
    params = [SamplingParams(max_tokens=4, ignore_eos=True)] * 4
    for res, p, s in zip(_run(str(prefill.socket), prompts, params), prompts, params, strict=True):
        assert not isinstance(res, BaseException), res
        assert res.tokens == reference.generate(model, p, s, block_size=BLOCK)
    assert _status(good.socket).served == 4


@pytest.mark.parametrize(
    ("decodes", "message"),
    [
        (["/tmp/x.sock", "/tmp/../tmp/x.sock"], "given twice"),
        (["/tmp/x.sock", "tcp://127.0.0.1:9"], "mixes Unix sockets and tcp://"),
    ],
)
def test_a_bad_decode_list_is_refused_at_start(tmp_path: Path, decodes: list[str], message: str):
    args = [a for d in decodes for a in ("--decode", d)]
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(tmp_path), "prefill", "start"]
    done = subprocess.run(
        [*argv, "--device", "cpu", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert message in done.stderr + done.stdout


def test_a_decode_killed_under_load_fails_only_what_it_held(trio, tiny):
    """SIGKILL one decode while 24 requests stream: each request either completes with the
    reference's tokens or ends with LINK_LOST (none hangs, none is wrong), every request after it
    succeeds on the other decode, and the prefill's pool comes back whole."""
    model, _ = tiny
    a, b = trio["a"].start("decode"), trio["b"].start("decode")
    prefill = _start_prefill(trio, str(a.socket), str(b.socket))
    _until(lambda: all(lk["state"] == "up" for lk in _status(prefill.socket).links), "links up")
    prompts = [[(11 * i + j) % 256 for j in range(8 + 5 * i)] for i in range(24)]
    params = [SamplingParams(max_tokens=48, ignore_eos=True)] * 24

    async def load_and_kill():  # type: ignore[no-untyped-def]
        tasks = [
            asyncio.create_task(
                client.generate(str(prefill.socket), prompt_tokens=p, sampling=s, timeout=60)
            )
            for p, s in zip(prompts, params, strict=True)
        ]
        while (await client.status(str(a.socket))).inflight == 0:  # A holds some: kill it
            await asyncio.sleep(0.01)
        a.stop(signal.SIGKILL)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(load_and_kill())
    lost = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(r, client.RequestFailed) and r.code == ErrorCode.LINK_LOST for r in lost)
    assert len(lost) < 24, "the other decode served none"  # 0 lost: A held only early offers
    for res, p, s in zip(results, prompts, params, strict=True):
        if not isinstance(res, BaseException):
            assert res.tokens == reference.generate(model, p, s, block_size=BLOCK)
    after = _run(str(prefill.socket), prompts[:6], params[:6])
    assert all(not isinstance(r, BaseException) for r in after), after
    _until(
        lambda: (
            (st := _status(prefill.socket)).pool["free"] == st.pool["total"] and not st.inflight
        ),
        "the prefill's pool did not come back whole",
    )


def test_status_over_several_runtime_dirs_shows_every_daemon(trio):  # type: ignore[no-untyped-def]
    """`pdkv status DIR...`: one line per daemon of each runtime dir; exit 1 once one is down."""
    a, b = trio["a"].start("decode"), trio["b"].start("decode")
    prefill = _start_prefill(trio, str(a.socket), str(b.socket))
    _until(lambda: all(lk["state"] == "up" for lk in _status(prefill.socket).links), "links up")
    dirs = [str(trio[n].runtime) for n in ("a", "b", "p")]

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "pdkv.cli", "status", *args, *dirs]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    done = status()
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("decode   up") == 2 and "decodes 2/2 up" in done.stdout
    a.stop(signal.SIGKILL)
    done = status("--json")
    assert done.returncode == 1
    daemons = json.loads(done.stdout)["daemons"]
    down = [d for d in daemons if "down" in d]
    assert [d["runtime_dir"] for d in down] == [dirs[0]] and len(daemons) == 3
    b.stop()  # stopped cleanly: its socket is gone, and its dir is still named, down
    done = status("--json")
    down = [d["runtime_dir"] for d in json.loads(done.stdout)["daemons"] if "down" in d]
    assert done.returncode == 1 and down == dirs[:2]
