"""Framed, full-duplex I/O on a connected Unix socket, with file descriptors (SCM_RIGHTS).

The read side (buffer, fds, `recv`/`dispatch`/`spin`, the idle and frame deadlines) is
common/wire/frame_reader.py's FrameReader; FrameChannel adds the send path and close(). `send` writes a
whole frame at once when the socket is free, else in order behind the pending write, so concurrent
senders never interleave; `write_nowait` does the same without awaiting, with a bound on what may
queue for a peer that does not read. `connect` opens a channel to a socket path.
"""

from __future__ import annotations

import array
import asyncio
import functools
import socket

from common.errors import ProtocolError
from common.protocol import Message, encode
from common.wire.frame_reader import MAX_FDS_HELD, MAX_FDS_PER_MSG, FrameReader

__all__ = ["MAX_FDS_HELD", "MAX_FDS_PER_MSG", "FrameChannel", "connect", "peer_credentials"]


class FrameChannel(FrameReader):
    """One connected SOCK_STREAM Unix socket, framed, both directions. Not thread-safe; one
    event loop."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        max_buffer: int = 8 * 1024 * 1024,
        max_queued: int = 64 * 1024 * 1024,
        max_fds: int = MAX_FDS_HELD,
    ) -> None:
        super().__init__(sock, max_buffer=max_buffer, max_fds=max_fds)
        self._send_lock = asyncio.Lock()
        self._tail: asyncio.Task[None] | None = None  # the last write task started
        self._wfut: asyncio.Future[None] | None = None  # a write waiting for the socket to drain
        self._queued = 0  # bytes given to write_nowait and not yet written
        self._max_queued = max_queued

    # ---- writing -------------------------------------------------------------------------------
    async def send(self, msg: Message, fds: list[int] | None = None) -> None:
        """Write one whole frame (with fds attached to its first byte)."""
        await self.send_bytes(encode(msg), fds)

    async def send_bytes(self, data: bytes, fds: list[int] | None = None) -> None:
        """Write whole frames. A frame once started is finished even if the caller is cancelled
        (shielded), so a cancelled sender never leaves half a frame for the next one to follow.

        When nothing else is being written and the socket takes all of it, the frame leaves in
        this call, without a writer task and the loop iteration it costs (~10 µs a message).
        Only a Unix socket carries fds: on a TCP link such a frame is refused (ProtocolError)."""
        if fds and self.sock.family != socket.AF_UNIX:
            raise ProtocolError("a frame with file descriptors cannot travel over a TCP link")
        if not fds and self._idle_writer():
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
        task = self._loop.create_task(self._write(data, fds))
        # until it has the lock, only _tail tells later senders that a frame is half written
        self._tail = task
        task.add_done_callback(_retrieve)
        await asyncio.shield(task)

    def _idle_writer(self) -> bool:
        return (self._tail is None or self._tail.done()) and not self._send_lock.locked()

    def write_nowait(self, data: bytes) -> None:
        """Send whole frames without awaiting: at once when the socket takes them and no earlier
        write is pending (the common case: no loop iteration between the decision and the
        syscall), else in order after the pending ones. A broken socket shows up on the read side.

        A peer that does not read cannot make the queue grow without bound: past `max_queued`
        bytes waiting, the channel fails (its reader sees ConnectionError) and drops the frame.
        """
        if self._closed or self._queued > self._max_queued:
            return
        if self._idle_writer():
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return
            if sent == len(data):
                return
            data = data[sent:]
        self._queued += len(data)
        if self._queued > self._max_queued:
            self.fail(ConnectionError(f"peer is not reading: {self._queued} bytes queued for it"))
            return
        self._tail = self._loop.create_task(self._write(data, None))
        self._tail.add_done_callback(_retrieve)
        self._tail.add_done_callback(functools.partial(self._unqueue, len(data)))

    @property
    def queued(self) -> int:
        """Bytes given to write_nowait that the socket has not taken yet."""
        return self._queued

    def _unqueue(self, n: int, _task: asyncio.Task[None]) -> None:
        self._queued -= n

    async def drain(self) -> None:
        """Wait until every frame given to write_nowait has been written (or failed)."""
        if self._tail is not None:
            await asyncio.gather(self._tail, return_exceptions=True)

    async def _write(self, data: bytes, fds: list[int] | None) -> None:
        async with self._send_lock:
            view = memoryview(data)
            if fds:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                sent = await self._retry(lambda: self.sock.sendmsg([view], anc))
                view = view[sent:]
            while view:
                sent = await self._retry(lambda v=view: self.sock.send(v))
                view = view[sent:]

    async def _retry(self, op) -> int:  # type: ignore[no-untyped-def]
        while True:
            if self._closed:
                raise ConnectionError("channel closed")
            try:
                return op()
            except (BlockingIOError, InterruptedError):
                fut = self._wfut = self._loop.create_future()
                self._loop.add_writer(self._fileno, _resolve, fut)
                try:
                    await fut  # close() fails it, after taking the writer off the loop
                finally:
                    self._wfut = None
                    if not self._closed:
                        self._loop.remove_writer(self._fileno)

    # ---- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Idempotent: stop reading, close unclaimed fds and the socket."""
        if self._closed:
            return
        self._closed = True
        # a write waiting for the socket must come off the loop before the fd is closed (uvloop
        # aborts the process on a closed fd it still polls) and must fail, not wait forever
        if self._wfut is not None:
            self._loop.remove_writer(self._fileno)
            if not self._wfut.done():
                self._wfut.set_exception(ConnectionError("channel closed during a write"))
        self._close_reading()
        self.sock.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def peer_credentials(self) -> tuple[int, int, int]:
        """(pid, uid, gid) of the peer process, from SO_PEERCRED."""
        return peer_credentials(self.sock)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # a failed write is seen by the reader as EOF; do not warn twice


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, array.array("i", [0, 0, 0]).itemsize * 3
    )
    creds = array.array("i")
    creds.frombytes(raw)
    return creds[0], creds[1], creds[2]


async def connect(path: str) -> FrameChannel:
    """Connect to a Unix socket at `path` and wrap it in a FrameChannel. An OSError of the
    connect (no socket there, nothing listening, not allowed) names `path`, as open() would:
    the same class, `filename` set."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, path)
    except OSError as exc:
        sock.close()
        if exc.errno is None or exc.filename is not None:
            raise
        raise type(exc)(exc.errno, exc.strerror, path) from None
    except BaseException:
        sock.close()
        raise
    return FrameChannel(sock)
