"""The file descriptors that arrive with a framed channel's bytes (SCM_RIGHTS ancillary data).

The frame reader (common/wire/frame_reader.py) hands every recvmsg's ancillary data here. fds are held
in arrival order up to `max_fds` unclaimed, for the frame that announced them to take
(`take(n)`: the REGISTER takes one per region); the rest are closed at once, so a peer cannot make
a connection hold descriptors the protocol does not expect. With `max_fds` 0, or while the reader
dispatches established-link frames (which carry none), every fd is closed on arrival.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
from collections import deque

from common.errors import ProtocolError

#: At most this many fds are accepted per recvmsg; more is a protocol error.
MAX_FDS_PER_MSG = 16
#: Default cap on fds a connection may hold unclaimed (a REGISTER needs one per region).
MAX_FDS_HELD = 16
#: The ancillary buffer recvmsg needs for MAX_FDS_PER_MSG fds.
CMSG_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MSG * array.array("i").itemsize)


class FdInbox:
    """fds received and not yet claimed, oldest first. Not thread-safe; one event loop."""

    def __init__(self, max_fds: int = MAX_FDS_HELD) -> None:
        self.max_fds = max_fds
        self._fds: deque[int] = deque()

    def __len__(self) -> int:
        return len(self._fds)

    def arrived(
        self, ancdata: list[tuple[int, int, bytes]], *, accepting: bool
    ) -> ProtocolError | None:
        """Queue the fds in one recvmsg's ancillary data up to `max_fds` held (none unless
        `accepting`) and close the rest at once. Returns the error that fails the channel when
        an accepting connection (max_fds > 0) went past its cap, else None."""
        error = None
        for level, kind, payload in ancdata:
            if level != socket.SOL_SOCKET or kind != socket.SCM_RIGHTS:
                continue
            fds = array.array("i")
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            room = max(self.max_fds - len(self._fds), 0) if accepting else 0
            self._fds.extend(fds[:room])
            close_fds(fds[room:])
            if len(fds) > room and self.max_fds and accepting:
                error = ProtocolError(
                    f"more than {self.max_fds} file descriptors held by one connection"
                )
        return error

    def take(self, n: int) -> list[int]:
        """The next n fds received, in order; ProtocolError if fewer arrived."""
        if len(self._fds) < n:
            raise ProtocolError(
                f"expected {n} file descriptors with the frame, got {len(self._fds)}"
            )
        return [self._fds.popleft() for _ in range(n)]

    def close(self) -> None:
        """Close every fd still unclaimed. Idempotent."""
        while self._fds:
            close_fds([self._fds.popleft()])


def close_fds(fds: list[int] | array.array[int]) -> None:
    """Close each fd, ignoring any already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


__all__ = ["CMSG_SPACE", "MAX_FDS_HELD", "MAX_FDS_PER_MSG", "FdInbox", "close_fds"]
