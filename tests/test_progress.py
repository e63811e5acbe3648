"""pdkv.progress: the demo's progress counter, redrawn on a terminal and whole lines elsewhere."""

from __future__ import annotations

import io
import os
import pty

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
            written = os.read(screen.fileno(), 4096)
    finally:
        os.close(leader)
        os.close(follower)
    # the terminal turns "\n" into "\r\n" on output (onlcr)
    assert written == b"\r  1/2 done\r  2/2 done\r\n"
