"""Several API processes on one port (`pdkv api start --workers N`): a supervisor and N workers.

One API process passes every streamed token through one Python event loop, ~30 µs of its CPU a
token on the CPU VM (docs/benchmarks.md, "The HTTP API's CPU per token under load"): one core
carries ~33k tokens/s. With `--workers N` the process that `pdkv api start` runs binds the port,
writes the pidfile and URL file as one API does, and starts N workers: each is `pdkv api start`
again with the same settings, the listening socket inherited (its descriptor in FD_ENV), and its
own connections to the daemons; the kernel hands each new connection to one of them. The
supervisor serves nothing itself:

- SIGTERM or SIGINT: the supervisor closes its copy of the listening socket and passes SIGTERM to
  every worker, which stops listening and drains as a lone API does (--drain-timeout), so the
  port refuses new connections at once; a worker still running `KILL_GRACE_S` after that is
  killed. Exit 0 when every worker stopped cleanly (one still starting may die of the signal),
  1 otherwise.
- A worker that exits while the API is not stopping is started again (`api_worker_exited`, then
  `api_worker_started`), however short its life, once it had begun to serve (it says so through a
  pipe, READY_ENV); MAX_EXITS_BEFORE_SERVING in a row that exit before they serve (as every worker would,
  failing at start: a bad checkpoint, a refused key) end the API with exit 1.
- A worker whose supervisor dies gets SIGTERM (PR_SET_PDEATHSIG): no orphan keeps the port.
- /metrics: the API's own series are summed over the workers, dead ones' counts included
  (prometheus_client's multiprocess mode; its files in RUNTIME_DIR/api-PORT.metrics/, emptied at
  start, removed at exit; the in-flight gauge sums the live workers only). The daemons' series
  come from the worker that answers the scrape, which asks the daemons as a lone API does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

#: a worker's environment: the inherited listening socket's descriptor, its index, the
#: supervisor's pid and start time (/v1/models' `created`, the same from every worker)
FD_ENV, INDEX_ENV, PARENT_ENV, CREATED_ENV = (
    "PDKV_API_WORKER_FD",
    "PDKV_API_WORKER",
    "PDKV_API_SUPERVISOR",
    "PDKV_API_CREATED",
)
#: the write end of a pipe a worker writes one byte to as it begins to serve
READY_ENV = "PDKV_API_WORKER_READY"
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when it is imported
MAX_EXITS_BEFORE_SERVING = 3
KILL_GRACE_S = 5.0
POLL_S = 0.1
#: a worker's exit codes that end a stop cleanly
_CLEAN = frozenset({0, -signal.SIGTERM, -signal.SIGINT})
_PR_SET_PDEATHSIG = 1


def worker_index() -> int | None:
    """This process's worker index, None unless a supervisor started it."""
    value = os.environ.get(INDEX_ENV)
    return int(value) if value is not None and FD_ENV in os.environ else None


def metrics_dir() -> Path | None:
    """Where this worker's metrics go (shared with the others), None outside a worker."""
    value = os.environ.get(METRICS_ENV)
    return Path(value) if value and worker_index() is not None else None


def created() -> int | None:
    """The supervisor's start (epoch seconds) in a worker, else None."""
    value = os.environ.get(CREATED_ENV)
    return int(value) if value and worker_index() is not None else None


def inherited_socket() -> int:
    """In a worker: ask for SIGTERM when the supervisor dies (and stop now if it already has),
    tag every log line with the worker's index, and return the listening socket's descriptor."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if str(os.getppid()) != os.environ.get(PARENT_ENV):
        raise SystemExit(1)  # the supervisor died before the death signal was asked for
    structlog.contextvars.bind_contextvars(worker=worker_index())
    return int(os.environ[FD_ENV])


def serving() -> None:
    """In a worker: tell the supervisor it serves now (its exits from now on are not start-up
    failures)."""
    fd = int(os.environ.get(READY_ENV, "-1"))
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.write(fd, b"1")
            os.close(fd)


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen
    ready: int  # the read end of its readiness pipe (-1 once read or closed)
    serving: bool = False

    def check_ready(self) -> None:
        """Whether it said it serves (a byte on its pipe, read without blocking)."""
        if self.ready < 0:
            return
        try:
            said = os.read(self.ready, 1)
        except BlockingIOError:
            return
        self.serving = said == b"1"
        self.close()

    def close(self) -> None:
        if self.ready >= 0:
            os.close(self.ready)
            self.ready = -1


class Supervisor:
    """Starts and keeps `count` workers running `argv` on the listening socket `sock`."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        sock: socket.socket,
        count: int,
        metrics: Path,
        drain_s: float,
    ) -> None:
        self.argv, self.sock, self.count = argv, sock, count
        self.metrics, self.drain_s = metrics, drain_s
        fd = sock.fileno()
        self.env = {
            **env,
            FD_ENV: str(fd),
            PARENT_ENV: str(os.getpid()),
            CREATED_ENV: str(int(time.time())),
            METRICS_ENV: str(metrics),
        }
        self.workers: dict[int, _Worker] = {}
        self.exits_before_serving = 0
        self.stopping = False

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT or workers that keep failing; the exit code."""
        shutil.rmtree(self.metrics, ignore_errors=True)  # an earlier run's counts must not add up
        self.metrics.mkdir(mode=0o700)
        previous = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
        failed = False
        try:
            for i in range(self.count):
                self._start(i)
            while not self.stopping and not failed:
                time.sleep(POLL_S)
                failed = any(self._exited(w) for w in list(self.workers.values()))
            return max(self._stop_all(), int(failed))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            shutil.rmtree(self.metrics, ignore_errors=True)

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _start(self, index: int) -> None:
        fd = self.sock.fileno()
        ready, told = os.pipe()
        os.set_blocking(ready, False)
        env = {**self.env, INDEX_ENV: str(index), READY_ENV: str(told)}
        try:
            proc = subprocess.Popen(self.argv, env=env, pass_fds=(fd, told))
        except BaseException:
            os.close(ready)
            raise
        finally:
            os.close(told)
        self.workers[index] = _Worker(index, proc, ready)
        log.info("api_worker_started", worker=index, pid=proc.pid)

    def _exited(self, w: _Worker) -> bool:
        """Start again a worker that exited on its own; True when workers keep failing."""
        w.check_ready()
        code = w.proc.poll()
        if code is None or self.stopping:
            return False
        w.check_ready()  # a byte it wrote just before it exited
        w.close()
        self._forget(w.proc.pid)
        self.exits_before_serving = 0 if w.serving else self.exits_before_serving + 1
        if self.exits_before_serving >= MAX_EXITS_BEFORE_SERVING:
            log.error(
                "api_workers_failing",
                worker=w.index,
                pid=w.proc.pid,
                code=code,
                exits_before_serving=self.exits_before_serving,
            )
            return True
        log.warning("api_worker_exited", worker=w.index, pid=w.proc.pid, code=code, restart=True)
        self._start(w.index)
        return False

    def _stop_all(self) -> int:
        """Stop listening, SIGTERM every live worker, wait for its drain, kill what is left; 0
        when every worker ended cleanly: exit 0, or killed by the SIGTERM or SIGINT of the stop
        before it could serve (a worker still starting)."""
        self.sock.close()  # the port refuses new connections at once, as one API's does
        for w in self.workers.values():
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_s + KILL_GRACE_S
        code = 0
        for w in self.workers.values():  # those that died since the stop began included
            try:
                rc = w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                rc = w.proc.wait()
                log.error("api_worker_killed", worker=w.index, pid=w.proc.pid)
            w.close()
            self._forget(w.proc.pid)
            code = max(code, int(rc not in _CLEAN))
        return code

    def _forget(self, pid: int) -> None:
        """A dead worker's live gauges (requests in flight) leave the sums."""
        from prometheus_client import multiprocess

        with contextlib.suppress(OSError):
            multiprocess.mark_process_dead(pid, str(self.metrics))
