"""Triton's kernel cache directory (common.daemon.kernel_cache): the setting, TRITON_CACHE_DIR or the
default, set in the daemon process before anything imports triton.

The daemon test puts a stand-in `triton` package first on the daemon's path that records the
TRITON_CACHE_DIR it sees when imported and then fails like a missing triton; TRITON_INTERPRET=1
makes the CPU daemon try the import while it loads its model (and then run torch's path)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from common.daemon import kernel_cache
from common.settings import declared
from decode_server.config import DecodeConfig
from prefill_server.config import PrefillConfig
from tests.support.daemons import Pair

STAND_IN = """\
import os
with open({record!r}, "a") as fh:
    fh.write(os.environ.get("TRITON_CACHE_DIR", "<unset>") + "\\n")
raise ImportError("stand-in triton (tests/integration/test_kernel_cache.py)")
"""


def test_the_setting_wins_then_the_users_variable_then_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(kernel_cache.ENV, raising=False)
    assert kernel_cache.resolve(None) == (tmp_path / "xdg" / "pdkv" / "triton", "default")
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path / "users"))
    assert kernel_cache.resolve(None) == (tmp_path / "users", "env")
    assert kernel_cache.resolve(tmp_path / "set") == (tmp_path / "set", "setting")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert kernel_cache.default_dir() == Path.home() / ".cache" / "pdkv" / "triton"


def test_configure_makes_the_directory_and_sets_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path / "users"))
    told = kernel_cache.configure(tmp_path / "a" / "b")
    path = tmp_path / "a" / "b"
    assert told["dir"] == str(path) and told["source"] == "setting" and path.is_dir()
    assert (path.stat().st_mode & 0o777) == 0o700
    assert os.environ[kernel_cache.ENV] == str(path)


def test_the_setting_is_declared_once_with_its_option() -> None:
    opt = next(s for s in declared(DecodeConfig) if s.name == "kernel_cache_dir")
    assert opt.option.flag == "--kernel-cache-dir"
    assert opt.option.env == "PDKV_KERNEL_CACHE_DIR"
    assert any(s.name == "kernel_cache_dir" for s in declared(PrefillConfig))


@pytest.mark.parametrize("given", ["setting", "env", "default"])
def test_the_daemon_sets_the_cache_dir_before_triton_is_imported(
    pair_factory: Pair, tmp_path: Path, given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(kernel_cache.ENV, raising=False)  # an in-process runtime may have set it
    stand_in = tmp_path / "site" / "triton"
    stand_in.mkdir(parents=True)
    record = tmp_path / "imports.txt"
    (stand_in / "__init__.py").write_text(STAND_IN.format(record=str(record)))
    env = {"PYTHONPATH": str(tmp_path / "site"), "TRITON_INTERPRET": "1"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    args: list[str] = []
    expected = {
        "setting": tmp_path / "kernels",
        "env": tmp_path / "users",
        "default": tmp_path / "xdg" / "pdkv" / "triton",
    }[given]
    if given == "setting":
        args = ["--kernel-cache-dir", str(expected)]
        env["TRITON_CACHE_DIR"] = str(tmp_path / "users")  # the setting wins over it
    elif given == "env":
        env["TRITON_CACHE_DIR"] = str(expected)
    daemon = pair_factory.start("decode", *args, env=env)
    assert daemon.proc.poll() is None
    seen = record.read_text().splitlines()
    assert seen and set(seen) == {str(expected)}, seen  # triton was imported, after the setting
    assert expected.is_dir()
    line = next(json.loads(x) for x in daemon.log_text().splitlines() if '"kernel_cache"' in x)
    assert line["dir"] == str(expected) and line["source"] == given
    assert line["triton_imported_before"] is False
