"""systemd's readiness protocol (sd_notify) without libsystemd: one datagram per state change.

With `Type=notify` systemd sets NOTIFY_SOCKET to a datagram socket (a path, or `@name` in the
abstract namespace) and reads newline-separated `KEY=value` assignments from it: `READY=1` once
the daemon serves, `STOPPING=1` when it begins to stop, `STATUS=...` as a one-line state for
`systemctl status`. Without NOTIFY_SOCKET (not under systemd) every call does nothing.
"""

from __future__ import annotations

import os
import socket

import structlog

log = structlog.get_logger(__name__)


def notify(*assignments: str) -> bool:
    """Send `assignments` (e.g. "READY=1", "STATUS=serving") to $NOTIFY_SOCKET in one datagram.
    True if sent; False without NOTIFY_SOCKET or when the send fails (logged, never raised: a
    daemon must not die because its supervisor's socket went away)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(assignments).encode())
    except OSError as exc:
        log.warning("sd_notify_failed", socket=os.environ.get("NOTIFY_SOCKET"), error=str(exc))
        return False
    return True
