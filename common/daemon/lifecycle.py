"""What both daemons share around their asyncio loop: loop factory, signals, listening sockets.

Signals only set flags (as uvicorn does): the first SIGTERM/SIGINT asks for a graceful stop, which the
daemon carries out as a sequence (stop accepting, drain under a timeout, answer whoever waits, close
mappings, remove socket and pidfile); a second one forces the exit.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import grp
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar

import structlog

from common.daemon import heap, sched
from common.daemon.notify import notify
from common.daemon.rundir import claim_socket_path
from common.protocol import ErrorCode, encode, make_error
from common.wire.channel import peer_credentials

log = structlog.get_logger(__name__)
R = TypeVar("R")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when importable, asyncio's default loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Callable[[], Awaitable[int]]) -> int:
    """Run `main()` on a fresh loop (uvloop if available) and return its exit code.

    The GIL switch interval drops from 5 ms to 0.2 ms: the torch thread runs Python between its
    kernels, and the loop thread (link traffic, handoffs) must not wait milliseconds for the GIL.
    """
    sys.setswitchinterval(0.0002)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main())


def exit_now(code: int) -> NoReturn:
    """End a daemon process with `code` once its shutdown sequence is complete (sockets and
    pidfile removed, its last log line written): the atexit handlers run and stdio is flushed,
    then the process exits without CPython's interpreter finalization.

    That finalization does nothing a daemon needs (the kernel frees its memory, memfds and
    mappings) and takes long: repeated full GC passes over the heap torch and the model built
    (~1,300 modules), then torch's static destructors (its operator registry). An idle daemon
    took 0.8-1.3 s on a 2-core VM, 0.6-0.8 s on an H200 host (tiny model, cuda:0), to exit after
    its log said it stopped (issue 25 saw ~3 s): time during which `pdkv stop`, systemd or a
    container runtime waits for nothing.
    Call only at the process's entry point, never from a library or a test process.
    """
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def raise_fd_limit(want: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to `want` (never past the hard limit, never lower it).

    Returns (soft before, soft after). The default soft limit (often 1024) would otherwise meet
    EMFILE before `--max-connections` is reached; the hard limit is the operator's (LimitNOFILE=,
    ulimit -Hn, the container's), and a daemon stays within it.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return soft, target
    return soft, soft


#: Exit status of a daemon that ended because it could no longer serve (not 3: systemd's
#: RestartPreventExitStatus=3 is for configuration errors; this one should be restarted).
EXIT_FATAL = 1


class StopFlag:
    """Set by SIGTERM/SIGINT, or by `fail` from inside; a second signal exits at once (status 1)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.exit_code = 0
        self._loop = asyncio.get_running_loop()
        self._installed: list[int] = []

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self._loop.add_signal_handler(sig, self._on_signal, sig)
                self._installed.append(sig)

    def _on_signal(self, sig: int) -> None:
        if self.event.is_set():
            log.warning("forced_exit", signal=signal.Signals(sig).name)
            os._exit(1)
        log.info("stop_requested", signal=signal.Signals(sig).name)
        self.event.set()

    def fail(self, reason: str) -> None:
        """The daemon can no longer serve: stop it now and make it exit with EXIT_FATAL."""
        log.critical("daemon_failed", reason=reason, exit_code=EXIT_FATAL)
        self.exit_code = EXIT_FATAL
        self.event.set()

    def uninstall(self) -> None:
        for sig in self._installed:
            self._loop.remove_signal_handler(sig)
        self._installed.clear()


def bind_unix_socket(path: Path, *, group: str | None = None, backlog: int = 512) -> socket.socket:
    """A listening socket at `path`: 0600, or 0660 owned by `group`. Stale sockets are replaced."""
    claim_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket never exists with wider permissions
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    if group:
        gid = grp.getgrnam(group).gr_gid
        os.chown(path, -1, gid)
        os.chmod(path, 0o660)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def peer_allowed(sock: socket.socket, allowed_uids: frozenset[int], **ctx: Any) -> bool:
    """SO_PEERCRED check: True if the peer's uid is allowed; refusals are logged with pid and uid."""
    try:
        pid, uid, _ = peer_credentials(sock)
    except OSError as exc:
        log.warning("peer_credentials_failed", error=str(exc), **ctx)
        return False
    if uid in allowed_uids:
        return True
    log.warning("peer_refused", peer_pid=pid, peer_uid=uid, allowed=sorted(allowed_uids), **ctx)
    return False


class Server(Protocol):
    async def start(self) -> None: ...

    async def until_ready(self) -> None:
        """Return once the daemon serves (after start): systemd then gets READY=1."""
        ...

    async def shutdown(self) -> None: ...


async def serve_until_stopped(
    load: Callable[[], R],
    make_server: Callable[[R, StopFlag], Server],
    close: Callable[[R], None],
) -> int:
    """The daemon's life: signals armed first, then load (off the loop), start, wait for the
    stop flag, shut down. A SIGTERM during a long model load ends the daemon cleanly (exit 0).

    Under systemd (Type=notify) READY=1 goes out once `server.until_ready()` returns, STOPPING=1
    when the drain begins. The server may end itself through `StopFlag.fail` (exit EXIT_FATAL); a
    shutdown that raises is logged and exits EXIT_FATAL too, its pidfile left for `pdkv stop` to
    find and report."""
    stop = StopFlag()
    stop.install()
    sched.default_slice()  # not a slice of whoever started us: the threads made from here on
    pauses: heap.PauseWatch | None = None
    try:
        loaded = await asyncio.to_thread(load)
        if stop.event.is_set():
            close(loaded)
            log.info("stopped_during_load")
            return 0
        server = make_server(loaded, stop)
        await server.start()
        heap.freeze_startup_heap()  # no full collection walks the model's objects again
        # a frame that wakes the loop preempts what runs on its CPU (a client, the other
        # daemon's torch thread) instead of waiting for it to sleep: common/daemon/sched.py
        sched.set_slice(sched.LOOP_SLICE_US)
        pauses = heap.watch_pauses()
        ready = asyncio.create_task(_notify_ready(server), name="sd-notify-ready")
        await stop.event.wait()
        ready.cancel()
        notify("STOPPING=1", "STATUS=draining")
        try:
            await server.shutdown()
        except Exception:
            log.exception("shutdown_failed")
            return EXIT_FATAL
        return stop.exit_code
    finally:
        if pauses is not None:
            pauses.close()
        sched.default_slice()  # the caller's thread as it was (a test process's, say)
        stop.uninstall()


async def _notify_ready(server: Server) -> None:
    await server.until_ready()
    notify("READY=1", "STATUS=serving")


async def accept_loop(
    listen: socket.socket,
    allowed_uids: frozenset[int] | None,
    serve: Callable[[socket.socket], Awaitable[None]],
    tasks: set[asyncio.Task[None]],
    *,
    name: str,
    max_connections: int = 1024,
) -> None:
    """Accept connections until `listen` is closed; refuse peers whose uid is not allowed
    (logged; None: a TCP socket, whose peers prove a key instead), serve each other one in its
    own task, kept in `tasks` while it runs.

    Past `max_connections` open connections a new one gets ERROR NO_CAPACITY and is closed. An
    accept that fails (EMFILE/ENFILE out of fds, ENOMEM, ...) is logged and retried after a
    backoff of up to 1 s: the daemon keeps accepting once resources are back.
    """
    loop = asyncio.get_running_loop()
    conns: set[asyncio.Task[None]] = set()
    backoff = 0.0
    refusals = RateLimitedLog(f"{name}_connection_refused")
    while True:
        try:
            conn, _ = await loop.sock_accept(listen)
        except OSError as exc:
            if listen.fileno() == -1:
                return  # closed: the daemon is stopping
            backoff = min(max(backoff * 2, 0.01), 1.0)
            log.error("accept_failed", socket=name, error=str(exc), retry_s=backoff)
            await asyncio.sleep(backoff)
            continue
        if backoff:
            log.info("accept_recovered", socket=name)
            backoff = 0.0
        if allowed_uids is not None and not peer_allowed(conn, allowed_uids, socket=name):
            conn.close()
            continue
        if len(conns) >= max_connections:
            _refuse(conn, f"{len(conns)} connections open, the limit is {max_connections}")
            refusals.note(limit=max_connections, socket=name)
            continue
        task = asyncio.create_task(serve(conn), name=f"{name}-conn")
        for group in (tasks, conns):
            group.add(task)
            task.add_done_callback(group.discard)


def _refuse(conn: socket.socket, why: str) -> None:
    """Best effort ERROR NO_CAPACITY to a connection we will not serve, then close it."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(encode(make_error(ErrorCode.NO_CAPACITY, f"{why} (--max-connections)")))
    conn.close()


class RateLimitedLog:
    """One warning per `interval_s` at most for a repeated event, with how many were not logged
    (`not_logged_since`); the others go to debug."""

    def __init__(self, event: str, interval_s: float = 1.0) -> None:
        self.event = event
        self.interval_s = interval_s
        self.last = -interval_s
        self.skipped = 0

    def note(self, logger: Any = None, **fields: Any) -> None:
        logger = logger or log
        now = time.monotonic()
        if now - self.last < self.interval_s:
            self.skipped += 1
            logger.debug(self.event, **fields)
            return
        logger.warning(self.event, not_logged_since=self.skipped, **fields)
        self.last, self.skipped = now, 0
