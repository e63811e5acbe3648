"""The README's Python client example, extracted and run as written against a real pair in the
default runtime dir ($XDG_RUNTIME_DIR/pdkv)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.daemons import Pair

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text[text.index("### From Python") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README has no Python block under 'From Python'"
    return match.group(1)


def test_readme_client_example_runs(tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    xdg = Path(tmp_path_factory.mktemp("xdg", numbered=True))
    os.chmod(xdg, 0o700)
    pair = Pair(xdg / "pdkv")
    pair.runtime.mkdir(mode=0o700)
    try:
        pair.start("decode")
        pair.start("prefill")
        env = {**os.environ, "XDG_RUNTIME_DIR": str(xdg)}
        env.pop("PDKV_RUNTIME_DIR", None)
        proc = subprocess.run(
            [sys.executable, "-c", _example()], capture_output=True, text=True, env=env, timeout=120
        )
    finally:
        pair.kill_all()
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(re.match(r"(length|stop) Usage\(prompt_tokens=", line) for line in lines), lines
    assert any(line.startswith("finished: ") for line in lines), lines
    assert "refused: BAD_REQUEST" in lines, lines
    assert lines[-1].startswith("tiny-seed0-") and lines[-1].endswith(" up"), lines
