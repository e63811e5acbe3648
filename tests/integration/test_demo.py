"""`pdkv demo`, the README's main command, run as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_runs_the_pair_and_matches_the_reference(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdkv.cli",
            "demo",
            "--prompts",
            "5",
            "--max-tokens",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: every output equals the single-process reference" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("demo-")]
    assert len(rows) == 5 and all(" yes " in row for row in rows)
    assert "tokens/s" in proc.stdout and "handoff p50" in proc.stdout
    # the banner names the device --device auto resolved to, and says why the text is noise
    assert re.search(r"\(device (cpu|cuda:\d+)\)", proc.stderr), proc.stderr
    assert "random weights" in proc.stderr
    # stderr is a pipe here: the progress is whole lines, no carriage-return redraws
    assert "\r" not in proc.stderr, repr(proc.stderr)
    assert "  5/5 requests finished\n" in proc.stderr, proc.stderr
    # no log line (the reference's model load) lands in the table on stdout
    assert "model_loaded" not in proc.stdout and "model_loaded" not in proc.stderr
    assert not list(tmp_path.glob("pdkv-demo-*")), "demo left its runtime dir behind"


def test_demo_decode_device_is_checked_apart(tmp_path):
    """--decode-device puts the decode on its own device (two GPUs); one that does not exist
    here is refused in one line, naming that option, before anything starts."""
    argv = [sys.executable, "-m", "pdkv.cli", "demo", "--device", "cpu"]
    proc = subprocess.run(
        [*argv, "--decode-device", "cuda:7", "--prompts", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)},
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: --decode-device: "), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("pdkv-demo-*"))
