"""Pidfiles (common/daemon/rundir.py) with real processes: a daemon killed with -9 whose parent has
not reaped it yet (a zombie: a supervisor's child, or a test's) is not running, so a new start
may take its pidfile at once instead of saying "already running" until the parent waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.daemon.rundir import check_free, pid_alive, read_pid, write_pidfile


def _state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, Z, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_killed_unreaped_daemon_does_not_hold_its_pidfile(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pidfile = tmp_path / "decode.pid"
    pidfile.write_text(f"{proc.pid}\n")
    try:
        assert read_pid(pidfile) == proc.pid  # alive: it holds the pidfile
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _state(proc.pid) != "Z":  # dead, and not waited for: a zombie
            assert time.monotonic() < deadline, _state(proc.pid)
            time.sleep(0.01)
        assert not pid_alive(proc.pid)
        assert read_pid(pidfile) is None
        check_free(tmp_path / "decode.sock", pidfile)  # no "names a running daemon"
        write_pidfile(pidfile)
        assert int(pidfile.read_text()) == os.getpid()
        assert _state(proc.pid) == "Z"  # the checks did not reap it: still the parent's to wait
    finally:
        proc.kill()
        proc.wait()
