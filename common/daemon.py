"""What both daemons share around their asyncio loop: loop factory, signals, listening sockets.

Signals only set flags (as uvicorn does): the first SIGTERM/SIGINT asks for a graceful stop, which the
daemon carries out as a sequence (stop accepting, drain under a timeout, answer whoever waits, close
mappings, remove socket and pidfile); a second one forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import structlog

from common.channel import peer_credentials
from common.notify import notify
from common.rundir import claim_socket_path

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


class StopFlag:
    """Set by SIGTERM/SIGINT; a second signal exits at once with status 1."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
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
    load: Callable[[], R], make_server: Callable[[R], Server], close: Callable[[R], None]
) -> int:
    """The daemon's life: signals armed first, then load (off the loop), start, wait for the
    stop flag, shut down. A SIGTERM during a long model load ends the daemon cleanly (exit 0).
    Under systemd (Type=notify) READY=1 goes out once `server.until_ready()` returns, STOPPING=1
    when the drain begins."""
    stop = StopFlag()
    stop.install()
    try:
        loaded = await asyncio.to_thread(load)
        if stop.event.is_set():
            close(loaded)
            log.info("stopped_during_load")
            return 0
        server = make_server(loaded)
        await server.start()
        ready = asyncio.create_task(_notify_ready(server), name="sd-notify-ready")
        await stop.event.wait()
        ready.cancel()
        notify("STOPPING=1", "STATUS=draining")
        await server.shutdown()
        return 0
    finally:
        stop.uninstall()


async def _notify_ready(server: Server) -> None:
    await server.until_ready()
    notify("READY=1", "STATUS=serving")


async def accept_loop(
    listen: socket.socket,
    allowed_uids: frozenset[int],
    serve: Callable[[socket.socket], Awaitable[None]],
    tasks: set[asyncio.Task[None]],
    *,
    name: str,
) -> None:
    """Accept connections until `listen` is closed; refuse peers whose uid is not allowed
    (logged), serve each other one in its own task, kept in `tasks` while it runs."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn, _ = await loop.sock_accept(listen)
        except OSError:
            return
        if not peer_allowed(conn, allowed_uids, socket=name):
            conn.close()
            continue
        task = asyncio.create_task(serve(conn), name=f"{name}-conn")
        tasks.add(task)
        task.add_done_callback(tasks.discard)
