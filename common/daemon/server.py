"""The life cycle both daemons share (as uvicorn's Server): start, serve, drain, stop, status.

`DaemonServer.start` listens on the daemon's socket (0600/0660), writes the pidfile, starts the
subclass's parts and accepts connections (SO_PEERCRED-checked), each served in its own task.
`shutdown` is one sequence: stop accepting and remove the socket; wait, under `drain_timeout_s`,
while work is in flight (not when the daemon has failed: nothing would finish); `end_remaining` (answer whoever still waits, end the links); cancel and
await every task; close the model runtime and the subclass's parts; remove the pidfile. Signals
and the model load around it are `common.daemon.lifecycle.serve_until_stopped`'s.

A subclass gives: `role`, the socket path, `serve_connection(sock)`, `in_flight()`,
`end_remaining()`, `links()` and `throughput` for STATUS, and optionally `start_parts()`,
`until_ready()` (systemd's READY=1), `refuse_new()`, `close_parts()` and `log_stopped()`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, ClassVar

import structlog

from common.daemon import lifecycle
from common.daemon.config import DaemonConfig
from common.daemon.rundir import remove_file, write_pidfile
from common.daemon.runtime import ModelRuntime
from common.daemon.throughput import Throughput
from common.protocol import StatusReply

log = structlog.get_logger(__name__)

#: fds a daemon needs besides its connections: links, pool, event ring, logs, torch, pipes.
FD_HEADROOM = 256


class DaemonServer:
    role: ClassVar[str]
    in_flight_name: ClassVar[str]  # what in_flight() counts, for the draining log line
    peer_name: ClassVar[str]  # who connects to the socket, for the accept loop's log lines

    def __init__(
        self, cfg: DaemonConfig, rt: ModelRuntime, socket_path: Path, stop: lifecycle.StopFlag
    ) -> None:
        self.cfg = cfg
        self.rt = rt
        self.stop_flag = stop  # `stop_flag.fail(reason)` ends a daemon that can no longer serve
        self.socket_path = socket_path
        self.started = time.monotonic()
        self.stopping = False
        self._listen: socket.socket | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- the subclass's part ---------------------------------------------------------------------
    async def serve_connection(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def in_flight(self) -> int:
        raise NotImplementedError

    async def end_remaining(self) -> None:
        """After the drain: answer whatever still waits, end the links."""
        raise NotImplementedError

    def failure(self) -> BaseException | None:
        """Why the daemon cannot serve any more (then nothing is drained), or None."""
        return None

    def links(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    @property
    def throughput(self) -> Throughput:
        """Requests finished and tokens generated, for STATUS."""
        raise NotImplementedError

    async def until_ready(self) -> None:
        """Return once the daemon serves (after start): systemd then gets READY=1."""

    def refuse_new(self) -> None:
        """The drain begins: refuse new work from now on."""

    def start_parts(self) -> None:
        """Start background parts (a link, a loop) once the socket listens."""

    def close_parts(self) -> None:
        """Close what the subclass holds beyond the runtime; never raises."""

    def log_stopped(self) -> dict[str, Any]:
        """Fields of the `<role>_stopped` log line."""
        return {}

    # ---- life cycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self._fd_limit()
        self._listen = lifecycle.bind_unix_socket(self.socket_path, group=self.cfg.socket_group)
        write_pidfile(self.cfg.pidfile)
        self.start_parts()
        accept = lifecycle.accept_loop(
            self._listen,
            self.cfg.uids(),
            self.serve_connection,
            self._tasks,
            name=self.peer_name,
            max_connections=self.cfg.max_connections,
        )
        self.spawn(accept, f"{self.role}-accept")
        log.info(f"{self.role}_ready", socket=str(self.socket_path), pid=os.getpid())

    def _fd_limit(self) -> None:
        """Room for --max-connections plus the daemon's own fds (links, pool, logs, torch)."""
        want = self.cfg.max_connections + FD_HEADROOM
        before, after = lifecycle.raise_fd_limit(want)
        if after < want:
            log.warning(
                "fd_limit_below_max_connections",
                fd_limit=after,
                max_connections=self.cfg.max_connections,
                hint="raise LimitNOFILE= / ulimit -Hn, or lower --max-connections",
            )
        elif after > before:
            log.info("fd_limit_raised", before=before, after=after)

    async def shutdown(self) -> None:
        """Stop accepting, drain in-flight work under the timeout, end the rest, close."""
        self.stopping = True
        self.refuse_new()
        failure = self.failure()
        log.info(
            f"{self.role}_draining",
            **{self.in_flight_name: self.in_flight()},
            failed=failure is not None,
        )
        if self._listen is not None:
            self._listen.close()
            remove_file(self.socket_path)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while failure is None and self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # a daemon that failed would finish nothing: no drain
        await self.end_remaining()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.rt.close()
        self.close_parts()
        remove_file(self.cfg.pidfile)
        log.info(f"{self.role}_stopped", **self.log_stopped())

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A task the shutdown cancels and awaits."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def status(self) -> StatusReply:
        return StatusReply(
            role=self.role,
            pid=os.getpid(),
            uptime_s=round(time.monotonic() - self.started, 3),
            pool=self.rt.pool_stats(),
            inflight=self.in_flight(),
            links=self.links(),
            device=str(self.rt.device),
            backend=self.rt.backend,
            prefix_cache=self.prefix_cache_stats(),
            instance=self.cfg.instance_name,
            **self.rt.status_fields(self.throughput),
        )

    def prefix_cache_stats(self) -> dict[str, int]:
        """STATUS_REPLY's `prefix_cache` ({}: this daemon keeps none)."""
        stats = self.rt.prefix.stats() if self.rt.prefix is not None else {}
        if self.rt.host_tier is not None:  # the host tier's, `host_tier_` before each key
            stats |= {f"host_tier_{k}": v for k, v in self.rt.host_tier.stats().items()}
        return stats
