"""The runtime directory, pidfiles and socket files of the daemons.

Runtime dir: `$XDG_RUNTIME_DIR/pdkv` or `/tmp/pdkv-$UID`, created 0700. A pidfile or socket left by
a dead daemon is stale and removed on start; one owned by a live daemon is a clear startup error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from pathlib import Path

from common.errors import PdkvError


class StartupError(PdkvError):
    """The daemon cannot start (socket or pidfile held by a live daemon, bad directory)."""


def default_runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "pdkv" if base else Path(f"/tmp/pdkv-{os.getuid()}")


def ensure_runtime_dir(path: Path) -> Path:
    """Create `path` 0700 if missing; refuse one owned by another user or open to others."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise StartupError(
            f"runtime dir {path} belongs to uid {st.st_uid}, not to us ({os.getuid()})"
        )
    if st.st_mode & 0o077 and not os.environ.get("PDKV_SHARED_RUNTIME_DIR"):
        os.chmod(path, 0o700)
    return path


def pid_alive(pid: int) -> bool:
    """True while process `pid` runs. A zombie (it exited or was killed, and its parent, a
    supervisor say, has not reaped it yet) is gone: signal 0 still reaches it, its state is Z."""
    try:
        os.kill(pid, 0)
    except OSError as exc:
        if exc.errno != errno.EPERM:
            return False
    return _state(pid) != b"Z"


def _state(pid: int) -> bytes | None:
    """The state letter in /proc/PID/stat (after the command name, which may hold ")"), or None
    when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def child_pids(pid: int) -> list[int]:
    """The live child processes of `pid` (an API's workers); [] when it cannot be read."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def read_pid(pidfile: Path) -> int | None:
    """The pid in `pidfile` if the file exists, holds a pid and that process is alive."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and pid_alive(pid) else None


def write_pidfile(pidfile: Path) -> None:
    """Write our pid; StartupError if a live daemon holds the pidfile, stale ones are replaced."""
    other = read_pid(pidfile)
    if other is not None and other != os.getpid():
        raise StartupError(f"{pidfile} names a running daemon (pid {other}); stop it first")
    tmp = pidfile.with_suffix(".tmp")
    tmp.write_text(f"{os.getpid()}\n")
    tmp.replace(pidfile)


def remove_file(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def socket_in_use(path: Path) -> bool:
    """True if something accepts connections on the Unix socket at `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def claim_socket_path(path: Path) -> None:
    """Make `path` free to bind: remove a stale socket, refuse a live one or a non-socket file."""
    if not path.exists() and not path.is_symlink():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return
    if socket_in_use(path):
        raise StartupError(f"{path} is in use by a running daemon; stop it or pick another socket")
    if not path.is_socket():
        raise StartupError(f"{path} exists and is not a socket; remove it or pick another path")
    remove_file(path)


def check_free(sock: Path, pidfile: Path) -> None:
    """StartupError if a live daemon holds `sock` or `pidfile` (stale ones are left to clean)."""
    other = read_pid(pidfile)
    if other is not None and other != os.getpid():
        raise StartupError(f"{pidfile} names a running daemon (pid {other}); stop it first")
    if sock.exists() and socket_in_use(sock):
        raise StartupError(f"{sock} is in use by a running daemon; stop it or pick another socket")
