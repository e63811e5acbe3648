"""`pdkv api start --workers N` (api_server/workers.py): N real API processes on one port in front
of a real pair, /metrics summed over them, a killed worker started again, no worker left behind
by `pdkv stop` or by a supervisor that died; and the supervisor's policy with plain child
processes standing in for workers (one that fails at once, one that ignores SIGTERM)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from api_server import workers
from tests.support.api import MODEL, free_port, openai, short_runtime
from tests.support.daemons import Pair


def _cli(runtime: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(runtime), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _events(log: Path, event: str) -> list[dict]:
    lines = log.read_text().splitlines()
    return [e for e in map(json.loads, filter(None, lines)) if e.get("event") == event]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def _wait(predicate, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


async def _streams(url: str, prompts: list[str]) -> list[str]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as api:

        async def one(prompt: str) -> str:
            stream = await api.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def _metric(url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_workers_share_the_port_and_their_metrics(tmp_path_factory: pytest.TempPathFactory):
    runtime = short_runtime(tmp_path_factory)
    pair = Pair(runtime)
    try:
        pair.start("decode")
        pair.start("prefill")
        started = _cli(runtime, "api", "start", "--background", "--port", "0", "--workers", "2")
        assert started.returncode == 0, started.stderr
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", started.stdout).group(1)
        port = int(url.rsplit(":", 1)[1])
        log = runtime / "api-0.log"
        supervisor = int(re.search(r"pid (\d+)", started.stdout).group(1))
        assert (runtime / f"api-{port}.metrics").is_dir()
        status = _cli(runtime, "status")
        assert f"api      up    pid {supervisor}  {url}/v1  (2 workers)" in status.stdout
        listed = json.loads(_cli(runtime, "status", "--json").stdout)["apis"]
        assert listed == [{"port": port, "pid": supervisor, "url": url, "workers": 2}]

        # the same prompt gives the same greedy text from whichever worker serves it; keep
        # sending until both workers have served (the kernel picks the one that accepts)
        prompts = ["Hello", "KV blocks", "Hello", "KV blocks"] * 2
        sent, served = 0, set()
        texts: dict[str, set[str]] = {}
        while served != {0, 1} and sent < 160:
            for prompt, text in zip(prompts, asyncio.run(_streams(url, prompts)), strict=True):
                texts.setdefault(prompt, set()).add(text)
            sent += len(prompts)
            served = {e["worker"] for e in _events(log, "request_finished")}
        assert served == {0, 1}, f"one worker served all {sent} requests"
        assert all(len(t) == 1 and "" not in t for t in texts.values()), texts
        # any worker answering the scrape counts every worker's requests
        for _ in range(4):
            assert _metric(url, "pdkv_api_requests_total") == sent
            assert _metric(url, "pdkv_api_requests_in_flight") == 0
        assert _metric(url, "pdkv_daemon_up") == 1

        # a killed worker is started again; its counts stay in the sums
        first = {e["worker"]: e["pid"] for e in _events(log, "api_worker_started")}
        assert len(first) == 2 and all(_alive(p) for p in first.values())
        os.kill(first[0], signal.SIGKILL)
        assert _wait(lambda: len(_events(log, "api_worker_started")) == 3), log.read_text()
        exited = _events(log, "api_worker_exited")
        assert [(e["worker"], e["pid"], e["code"]) for e in exited] == [(0, first[0], -9)]
        asyncio.run(_streams(url, prompts))
        assert _metric(url, "pdkv_api_requests_total") == sent + len(prompts)
        # killed again and again once serving, within seconds of its start: not a start-up
        # failure, so the API goes on (three exits before serving would end it)
        for kills in (2, 3, 4):
            assert _wait(lambda k=kills: len(_events(log, "api_worker_serving")) == k + 1)
            newest = _events(log, "api_worker_started")[-1]["pid"]
            os.kill(newest, signal.SIGKILL)
            assert _wait(lambda k=kills: len(_events(log, "api_worker_started")) == k + 2)
        assert _wait(lambda: len(_events(log, "api_worker_serving")) == 6)
        assert asyncio.run(_streams(url, prompts[:2])) and _alive(supervisor)

        stopped = _cli(runtime, "stop", "api")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        now = {e["worker"]: e["pid"] for e in _events(log, "api_worker_started")}
        assert not _alive(supervisor) and not any(map(_alive, now.values()))
        assert not list(runtime.glob(f"api-{port}.*"))  # pidfile, URL file, metrics dir

        # a supervisor killed outright takes its workers with it (no orphan keeps the port)
        again = _cli(runtime, "api", "start", "--background", "--port", str(port), "--workers", "2")
        assert again.returncode == 0, again.stderr
        pid = int(re.search(r"pid (\d+)", again.stdout).group(1))
        kids = [e["pid"] for e in _events(runtime / f"api-{port}.log", "api_worker_started")]
        assert len(kids) == 2 and all(map(_alive, kids))
        os.kill(pid, signal.SIGKILL)
        assert _wait(lambda: not any(map(_alive, kids))), "a worker outlived its supervisor"
        with socket.socket() as s:  # nobody listens on the port any more
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT ones
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:
        _cli(runtime, "stop")
        pair.stop_all()


def _child(tmp_path: Path, body: str) -> list[str]:
    """A child process standing in for a worker: it notes its start in tmp_path/starts, then
    runs `body`."""
    starts = tmp_path / "starts"
    code = f"import os, signal, sys, time\nopen({str(starts)!r}, 'a').write('x')\n{body}"
    return [sys.executable, "-c", code]


def _supervise(
    tmp_path: Path, argv: list[str], count: int = 2, drain_s: float = 0.2, stop_after: float = 0
) -> int:
    """Supervisor.run() over `argv` on a real listening socket; SIGTERM to it (this process)
    after `stop_after` s when given. The socket is closed as the stop begins."""
    timer = threading.Timer(stop_after, os.kill, (os.getpid(), signal.SIGTERM))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sup = workers.Supervisor(argv, dict(os.environ), sock, count, tmp_path / "metrics", drain_s)
        if stop_after:
            timer.start()
        try:
            return sup.run()
        finally:
            timer.cancel()
            assert sock.fileno() == -1


#: a stand-in worker's line saying it serves, as api_server.workers.serving() does
SERVING = "os.write(int(os.environ['PDKV_API_WORKER_READY']), b'1')\n"


def test_workers_that_fail_before_they_serve_end_the_api(tmp_path: Path) -> None:
    assert _supervise(tmp_path, _child(tmp_path, "sys.exit(3)")) == 1
    # two started, each of the first two exits started one again, the third ended it
    assert (tmp_path / "starts").read_text() == "x" * 4
    assert not (tmp_path / "metrics").exists()


def test_a_worker_that_served_is_started_again_however_short_its_life(tmp_path: Path) -> None:
    """An OOM kill or a crash of serving workers, however often, is not a start-up failure."""
    dies = SERVING + "time.sleep(0.1)\nsys.exit(1)"
    t0 = time.monotonic()
    _supervise(tmp_path, _child(tmp_path, dies), count=2, stop_after=1.5)
    assert time.monotonic() - t0 >= 1.5  # ended by the stop, not by the workers' exits
    assert len((tmp_path / "starts").read_text()) >= 6


def test_a_worker_is_restarted_and_one_that_ignores_sigterm_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers, "KILL_GRACE_S", 0.3)
    # serves, then exits 0: started again every time; exits 0 on SIGTERM
    body = SERVING + "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\ntime.sleep(0.4)"
    assert _supervise(tmp_path, _child(tmp_path, body), count=1, stop_after=1.5) == 0
    assert len((tmp_path / "starts").read_text()) >= 3

    (tmp_path / "starts").unlink()
    t0 = time.monotonic()
    ignores = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)"
    assert _supervise(tmp_path, _child(tmp_path, ignores), count=1, stop_after=0.5) == 1
    assert time.monotonic() - t0 < 5  # killed after the drain and the grace, not 60 s


def test_a_worker_the_stop_kills_while_it_starts_is_a_clean_stop(tmp_path: Path) -> None:
    """A worker that has not installed its handlers yet dies of the stop's SIGTERM: exit 0."""
    slow = "time.sleep(60)"  # default SIGTERM action: killed, -15
    assert _supervise(tmp_path, _child(tmp_path, slow), count=2, stop_after=0.3) == 0


def _stream_in_thread(url: str, out: list) -> threading.Thread:  # type: ignore[type-arg]
    """A streamed completion on its own connection, in a thread: its text, or its exception,
    appended to `out` when it ends."""

    def run() -> None:
        try:
            with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as api:
                stream = api.completions.create(
                    model=MODEL, prompt="Hello", max_tokens=8, temperature=0, stream=True
                )
                out.append("".join(c.choices[0].text for c in stream if c.choices))
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_in_flight_counts_live_workers_and_a_stop_refuses_at_once(
    tmp_path_factory: pytest.TempPathFactory,
):
    """Requests held in flight (the decode stopped with SIGSTOP, within its link's heartbeat
    timeout, here raised past the test's length): the gauge counts them, drops to 0 when the workers serving them are
    killed, a stop refuses new connections at once while the workers drain, and a start on the
    same port begins its sums from nothing, whatever an earlier run left in its metrics dir."""
    runtime = short_runtime(tmp_path_factory)
    pair = Pair(runtime)
    try:
        pair.start("decode", "--heartbeat-timeout", "60")
        pair.start("prefill", "--heartbeat-timeout", "60")
        decode = pair.daemons["decode"].proc.pid
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        args = ("api", "start", "--background", "--port", str(port), "--workers", "2")
        assert _cli(runtime, *args).returncode == 0
        log, metrics = runtime / f"api-{port}.log", runtime / f"api-{port}.metrics"
        asyncio.run(_streams(url, ["Hello"] * 4))
        saved = {f.name: f.read_bytes() for f in metrics.iterdir()}  # an earlier run's counts

        held: list = []  # type: ignore[type-arg]
        os.kill(decode, signal.SIGSTOP)
        try:
            threads = [_stream_in_thread(url, held) for _ in range(4)]
            assert _wait(lambda: _metric(url, "pdkv_api_requests_in_flight") == 4, 5)
            for pid in [e["pid"] for e in _events(log, "api_worker_started")]:
                os.kill(pid, signal.SIGKILL)  # both workers, and the requests they held
            assert _wait(lambda: len(_events(log, "api_worker_started")) == 4, 5)
            assert _metric(url, "pdkv_api_requests_in_flight") == 0
        finally:
            os.kill(decode, signal.SIGCONT)
        for t in threads:
            t.join(10)
        assert len(held) == 4 and all(isinstance(x, Exception) for x in held), held

        drained: list = []  # type: ignore[type-arg]
        stop = None
        os.kill(decode, signal.SIGSTOP)
        try:
            threads = [_stream_in_thread(url, drained) for _ in range(2)]
            assert _wait(lambda: _metric(url, "pdkv_api_requests_in_flight") == 2, 5), drained
            stop = subprocess.Popen(
                [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(runtime), "stop", "api"]
            )
            assert _wait(lambda: _refused(port), 3), "the port still accepts during the drain"
            assert stop.poll() is None  # the workers still drain the two held requests
        finally:
            os.kill(decode, signal.SIGCONT)
            code = stop.wait(30) if stop is not None else None
        assert code == 0
        for t in threads:
            t.join(10)
        assert len(drained) == 2 and all(isinstance(x, str) and x for x in drained), drained

        metrics.mkdir(mode=0o700)  # as a supervisor killed outright leaves it
        for name, data in saved.items():
            (metrics / name).write_bytes(data)
        assert _cli(runtime, *args).returncode == 0
        asyncio.run(_streams(url, ["Hello"]))
        assert _metric(url, "pdkv_api_requests_total") == 1
    finally:
        _cli(runtime, "stop")
        pair.stop_all()


def _refused(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.connect(("127.0.0.1", port))
        except (ConnectionRefusedError, ConnectionResetError):  # reset: closed as it queued
            return True
    return False
