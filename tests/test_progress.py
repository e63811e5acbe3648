"""pdkv.progress: the demo's progress counter, redrawn on a terminal and whole lines elsewhere."""

from __future__ import annotations

import io
import os
import pty
import select
import time

from pdkv.progress import Progress


def test_off_a_terminal_each_count_is_a_whole_line() -> None:
    out = io.StringIO()  # isatty() is False, as for a pipe or a log file
    progress = Progress(out, 3, "requests finished")
    for _ in range(3):
        progress.advance()
    progress.close()
    assert "\r" not in out.getvalue()
    assert out.getvalue().splitlines(keepends=True) == [
        f"  {i}/3 requests finished\n" for i in (1, 2, 3)
    ]


def test_off_a_terminal_a_long_run_writes_a_line_per_tenth() -> None:
    out = io.StringIO()
    progress = Progress(out, 1000, "requests finished")
    for _ in range(1000):
        progress.advance()
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines == [f"  {n}/1000 requests finished" for n in range(100, 1001, 100)]


def test_on_a_terminal_the_line_is_redrawn_then_ended() -> None:
    leader, follower = pty.openpty()
    try:
        with open(follower, "w", closefd=False) as tty, open(leader, "rb", closefd=False) as screen:
            assert tty.isatty()
            progress = Progress(tty, 2, "done")
            progress.advance()
            progress.advance()
            progress.close()
            progress.close()  # idempotent: one line end only
            tty.write(MARK)  # what came before it is all that Progress wrote
            tty.flush()
            written = _read_until(screen.fileno(), MARK.encode())
    finally:
        os.close(leader)
        os.close(follower)
    # the terminal turns "\n" into "\r\n" on output (onlcr)
    assert written == b"\r  1/2 done\r  2/2 done\r\n" + MARK.encode()


MARK = "#end"


def _read_until(fd: int, end: bytes, timeout: float = 5.0) -> bytes:
    """What the terminal shows until `end`: its output reaches the other side in pieces."""
    got = b""
    deadline = time.monotonic() + timeout
    while not got.endswith(end):
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], f"only {got!r} in {timeout} s"
        got += os.read(fd, 4096)
    return got
