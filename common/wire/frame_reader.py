"""The receiving half of a framed Unix-socket channel (common/wire/channel.py's FrameChannel), with file
descriptors (SCM_RIGHTS).

asyncio's streams cannot carry ancillary data, and the shm backend passes its memfd with the REGISTER
frame, so the link reads with this instead: a reader callback drains the socket with recvmsg into a
buffer, and the fds that came with the bytes into common/wire/fd_inbox.py's FdInbox. Frames leave the
buffer either through `recv` (`readexactly` serves the frame decoder; reading pauses past `max_buffer` bytes) or, on an
established link, through `dispatch(handler)`, which splits and handles them in the callback
itself; `spin` polls instead of sleeping while an answer is due.

Per-connection memory stays small while a connection is idle or carries small frames: reads go
into a 16 KiB buffer, and a 256 KiB one exists only while a frame larger than that arrives. fds
are held only up to `max_fds` (0: every fd is closed on arrival; always 0 in dispatch mode, whose
frames carry none). A frame must complete within `watch_idle`'s frame timeout however slowly its
bytes trickle in.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import Callable

from common.errors import ProtocolError
from common.protocol import ConnectionClosed, Message, read_frame, split_frame
from common.protocol.frame import HEADER, HEADER_SIZE
from common.wire.fd_inbox import CMSG_SPACE, MAX_FDS_HELD, MAX_FDS_PER_MSG, FdInbox

_RECV_SIZE = 256 * 1024  # read buffer while a large frame arrives
_SMALL_RECV_SIZE = 16 * 1024  # read buffer otherwise
_SHRINK_ABOVE = 64 * 1024  # an empty frame buffer that grew past this is given back
_MSG_CTRUNC = int(socket.MSG_CTRUNC)  # plain int: IntFlag's & costs microseconds per message


class FrameReader:
    """The read side of one connected SOCK_STREAM Unix socket, framed; FrameChannel adds the
    write side and close(). Not thread-safe; one event loop."""

    def __init__(
        self, sock: socket.socket, *, max_buffer: int = 8 * 1024 * 1024, max_fds: int = MAX_FDS_HELD
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._fileno = sock.fileno()
        self._buf = bytearray()
        self._small = bytearray(_SMALL_RECV_SIZE)
        self._big: bytearray | None = None  # only while a large frame arrives
        self._fds = FdInbox(max_fds)
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._max_buffer = max_buffer
        self._reading = True
        self.last_rx = time.monotonic()  # when bytes last arrived (see watch_idle)
        self._frame_started = self.last_rx  # first byte of the frame now arriving (or last frame)
        self._closed = False  # set by FrameChannel.close
        self._handler: Callable[[Message], None] | None = None  # see dispatch()
        self._ended: asyncio.Future[None] | None = None
        self._spin_until = 0.0  # see spin()
        self._spin_while: Callable[[], bool] | None = None  # a conditional window's condition
        self._spin_while_until = 0.0
        self._spinning = False
        self._polled = False  # a conditional window's poll is reading (see polled)
        self._loop.add_reader(self._fileno, self._on_readable)

    # ---- reading -------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        rbuf = self._recv_buffer()
        try:
            # into a buffer allocated once: a fresh 256 KiB bytes per call would be an mmap +
            # munmap each time (above malloc's mmap threshold), ~100 µs per message
            nbytes, ancdata, flags, _ = self.sock.recvmsg_into([rbuf], CMSG_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._error = exc
            self._stop_reading()
            self._wake()
            return
        now = self.last_rx = time.monotonic()
        if ancdata:
            error = self._fds.arrived(ancdata, accepting=self._handler is None)
            self._error = error or self._error
        if flags & _MSG_CTRUNC:
            self._error = ProtocolError(f"more than {MAX_FDS_PER_MSG} fds in one message")
        if not nbytes:
            self._eof = True
            self._stop_reading()
        else:
            if not self._buf:
                self._frame_started = now
            self._buf += memoryview(rbuf)[:nbytes]
            if len(self._buf) > self._max_buffer and self._handler is None:
                self._stop_reading()
        if self._handler is not None:
            self._deliver()
        else:
            self._wake()

    def _recv_buffer(self) -> bytearray:
        """The small read buffer, or the large one while the frame in progress needs more than
        the small one holds (its header says how much)."""
        buf = self._buf
        if len(buf) >= HEADER_SIZE:
            _, _, _, meta, mem, ev = HEADER.unpack_from(buf)
            if HEADER_SIZE + meta + mem + ev - len(buf) > _SMALL_RECV_SIZE:
                if self._big is None:
                    self._big = bytearray(_RECV_SIZE)
                return self._big
        return self._small

    def _consumed(self) -> None:
        """A frame left the buffer: its successor's clock starts; memory of a large one goes."""
        self._frame_started = self.last_rx
        if not self._buf:
            self._big = None
            if sys.getsizeof(self._buf) > _SHRINK_ABOVE:
                self._buf = bytearray()

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fileno)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self._ended is not None and (self._error is not None or self._eof):
            self._end(self._error or self._eof_error())

    def _eof_error(self) -> Exception:
        if self._buf:
            return ProtocolError(f"connection closed inside a frame ({len(self._buf)} bytes)")
        return ConnectionClosed("peer closed the connection")

    def _end(self, exc: BaseException) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_exception(exc)

    # ---- dispatch: frames handled in the read callback -----------------------------------------
    async def dispatch(self, handler: Callable[[Message], None]) -> None:
        """Hand every frame to `handler` from the socket's read callback, until the channel
        ends; then raise why (ConnectionClosed at a clean EOF, ProtocolError, TimeoutError from
        watch_idle, or whatever `handler` raised, which ends the channel).

        Against `recv` in a loop this saves a future and a task wake-up per frame (~10 µs on
        each side of a round trip). `handler` runs on the loop and must not block; frames with
        file descriptors belong before dispatch (their fds stay unclaimed and are closed).
        """
        if self._handler is not None:
            raise RuntimeError("dispatch is already running on this channel")
        self._handler = handler
        self._ended = self._loop.create_future()
        try:
            self._deliver()  # what arrived while the caller still used recv
            if not self._reading and not self._closed and not self._eof:
                self._reading = True
                self._loop.add_reader(self._fileno, self._on_readable)
            await self._ended
        finally:
            self._handler = None
            self._ended = None

    def spin(self, seconds: float, *, while_: Callable[[], bool] | None = None) -> None:
        """Poll the socket without sleeping for the next `seconds` (dispatch mode only), when an
        answer is due soon: the loop keeps running instead of blocking in epoll, so the frame is
        read the moment it lands, without a wake-up of a sleeping process (~15-30 µs a frame on
        a VM; 100 µs and more for a vCPU that went idle). The loop serves everything else as
        usual meanwhile; zero or less does nothing.

        With `while_`, that window lasts only as long as `while_()` is true (asked before each
        poll: a cheap check), e.g. while a frame is awaited and nothing else needs the CPU. A
        window without it is kept whole; each new call replaces the conditional one."""
        if seconds <= 0 or self._handler is None:
            return
        until = time.monotonic() + seconds
        if while_ is None:
            self._spin_until = max(self._spin_until, until)
        else:
            self._spin_while, self._spin_while_until = while_, until
        if not self._spinning:
            self._spinning = True
            self._loop.call_soon(self._spin)

    @property
    def spinning(self) -> bool:
        """True while spin() keeps the loop polling this socket."""
        return self._spinning

    @property
    def polled(self) -> bool:
        """True while the frame being handled was read by a conditional window's poll (spin's
        `while_`), not by epoll or a plain window: for counting what the polling caught."""
        return self._polled

    def _spin(self) -> None:
        now = time.monotonic()
        if self._handler is None or not self._reading or not self._spin_on(now):
            self._spinning = False
            return
        self._polled = now >= self._spin_until  # only the conditional window keeps it open
        try:
            self._on_readable()  # BlockingIOError inside while nothing has arrived
        finally:
            self._polled = False
        self._loop.call_soon(self._spin)

    def _spin_on(self, now: float) -> bool:
        """Whether a spin window is still open (a conditional one whose condition went false
        is closed for good)."""
        if now < self._spin_until:
            return True
        cond = self._spin_while
        if cond is not None and now < self._spin_while_until and cond():
            return True
        self._spin_while = None
        return False

    def _deliver(self) -> None:
        handler = self._handler
        try:
            while handler is not None and self._error is None and not self._closed:
                got = split_frame(self._buf)
                if got is None:
                    break
                msg, n = got
                del self._buf[:n]
                self._consumed()
                handler(msg)
                handler = self._handler
        except Exception as exc:  # a bad frame or a handler's refusal ends the channel
            self._error = exc
            self._stop_reading()
        except BaseException as exc:  # e.g. a cancel: end dispatch, then let it propagate
            self._error = RuntimeError(f"dispatch handler raised {exc!r}")
            self._stop_reading()
            self._end(self._error)
            raise
        if self._error is not None or self._eof:
            self._end(self._error or self._eof_error())

    async def readexactly(self, n: int) -> bytes:
        """Exactly n bytes; asyncio.IncompleteReadError at EOF, as StreamReader does."""
        while len(self._buf) < n:
            if self._error is not None:
                raise self._error
            if self._eof:
                partial = bytes(self._buf)
                self._buf.clear()
                raise asyncio.IncompleteReadError(partial, n)
            if not self._reading and not self._closed:
                self._reading = True
                self._loop.add_reader(self._fileno, self._on_readable)
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = bytes(self._buf[:n])
        del self._buf[:n]
        self._consumed()
        if not self._reading and not self._eof and not self._closed:
            self._reading = True
            self._loop.add_reader(self._fileno, self._on_readable)
        return data

    async def recv(self) -> Message:
        """The next message (ConnectionClosed at a clean EOF, ProtocolError on bad bytes)."""
        return await read_frame(self)

    @property
    def max_fds(self) -> int:
        """fds held unclaimed beyond this are closed on arrival (0: every one)."""
        return self._fds.max_fds

    @max_fds.setter
    def max_fds(self, n: int) -> None:
        self._fds.max_fds = n

    def take_fds(self, n: int) -> list[int]:
        """The next n fds received, in order; ProtocolError if fewer arrived."""
        return self._fds.take(n)

    def fail(self, exc: BaseException) -> None:
        """Make the pending and every later read raise `exc` (e.g. a missed heartbeat)."""
        self._error = exc
        self._wake()

    def partial_age(self, now: float) -> float:
        """Seconds the frame now arriving has been incomplete (0 when no partial frame waits)."""
        return now - self._frame_started if self._buf else 0.0

    async def watch_idle(
        self, timeout: float, *, partial_only: bool = False, frame_timeout: float | None = None
    ) -> None:
        """Fail the channel with TimeoutError once nothing has arrived for `timeout` seconds
        (with `partial_only`: only while part of a frame is waiting for the rest — a client may
        be silent for as long as it likes between frames, not in the middle of one), or once a
        frame has been incomplete for `frame_timeout` seconds (default: `timeout` when
        `partial_only`, else never) however slowly its bytes trickle in.

        One sleeping task per connection instead of a timeout around every read: a timeout
        context costs ~10 µs per message, the dominant cost of a small frame.
        """
        if frame_timeout is None and partial_only:
            frame_timeout = timeout
        step = min(timeout, frame_timeout or timeout) / 4
        while not self._closed:
            now = time.monotonic()
            if not partial_only and now - self.last_rx >= timeout:
                self.fail(TimeoutError(f"nothing received for {timeout} s"))
                return
            if frame_timeout is not None and self.partial_age(now) >= frame_timeout:
                self.fail(
                    TimeoutError(f"the rest of a frame not received within {frame_timeout} s")
                )
                return
            await asyncio.sleep(step)

    def _close_reading(self) -> None:
        """The read side's part of close(): reading stops, a running dispatch ends with
        ConnectionClosed, pending and later reads see EOF, and unclaimed fds are closed."""
        self._stop_reading()
        self._end(ConnectionClosed("channel closed"))  # before _wake: closing is not a bad frame
        self._eof = True
        self._wake()
        self._fds.close()


__all__ = ["MAX_FDS_HELD", "MAX_FDS_PER_MSG", "FrameReader"]
