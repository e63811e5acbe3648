"""Blocking helpers to send bytes with file descriptors over a Unix socket (SCM_RIGHTS).

Linux attaches passed fds to the first byte of the sendmsg that carried them, and a recvmsg never
returns bytes from two sendmsg calls that both carry fds, so a message whose fds ride on its first
chunk arrives with them on the first recv. The helpers are for blocking sockets (a timeout set with
`settimeout` applies); an asyncio link can run them in a thread or use loop.sock_* equivalents.

Ownership: fds passed to `send_with_fds` stay owned by the caller (the kernel duplicates them);
fds returned by `recv_with_fds` / `recv_exact_with_fds` belong to the caller, who must close them
(ShmRegion.open does). On any error the receive helpers close every fd they received.
"""

from __future__ import annotations

import contextlib
import os
import socket

from common.errors import IpcError

# Linux caps SCM_RIGHTS at 253 fds per message (SCM_MAX_FD).
MAX_FDS = 253


def send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send all of `data`; `fds` travel with its first byte. Needs at least one byte of data."""
    if not data:
        raise IpcError("send_with_fds needs at least one byte of data to carry the fds")
    if len(fds) > MAX_FDS:
        raise IpcError(f"cannot pass {len(fds)} fds in one message; the limit is {MAX_FDS}")
    view = memoryview(data)
    sent = socket.send_fds(sock, [view], fds) if fds else sock.send(view)
    if sent < len(view):
        sock.sendall(view[sent:])


def recv_with_fds(sock: socket.socket, bufsize: int, maxfds: int) -> tuple[bytes, list[int]]:
    """One recvmsg of up to `bufsize` bytes and up to `maxfds` fds; b"" means the peer closed.

    Raises IpcError (closing every fd received) when the peer sent more fds than `maxfds` or the
    kernel truncated the control data (MSG_CTRUNC): fds were lost and the message cannot be trusted.
    """
    data, fds, flags, _ = socket.recv_fds(sock, bufsize, maxfds)
    if flags & socket.MSG_CTRUNC or len(fds) > maxfds:
        _close_all(fds)
        raise IpcError(
            f"peer sent more file descriptors than the {maxfds} expected (control data "
            "truncated); check both sides use the same protocol version"
        )
    return data, list(fds)


def recv_exact_with_fds(sock: socket.socket, nbytes: int, maxfds: int) -> tuple[bytes, list[int]]:
    """Exactly `nbytes` bytes and the fds that came with the first chunk.

    IpcError (closing received fds) if the peer closes first or sends fds on a later chunk.
    """
    chunks: list[bytes] = []
    fds: list[int] = []
    got = 0
    try:
        while got < nbytes:
            data, more = recv_with_fds(sock, nbytes - got, maxfds - len(fds))
            if more and chunks:
                fds.extend(more)
                raise IpcError("file descriptors arrived in the middle of a message")
            fds.extend(more)
            if not data:
                raise IpcError(f"peer closed the socket after {got} of {nbytes} bytes")
            chunks.append(data)
            got += len(data)
    except BaseException:
        _close_all(fds)
        raise
    return b"".join(chunks), fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
