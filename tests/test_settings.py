"""Settings declared once (common.settings): the config classes' fields are the options of
`pdkv decode|prefill|api start`, their environment variables, the command line of a detached
start and docs/operations.md's tables, so none of these can drift from the others."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from api_server.config import ApiConfig
from common import settings
from common.settings import Setting, declared
from decode_server.config import DecodeConfig
from pdkv import settings_doc
from pdkv.cli import cli
from pdkv.cli_options import config_options
from pdkv.commands import Globals, background_argv, make_config
from prefill_server.config import PrefillConfig

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = ROOT / "docs" / "operations.md"
CLASSES = {"decode": DecodeConfig, "prefill": PrefillConfig, "api": ApiConfig}


def _start(group: str) -> click.Command:
    return cli.commands[group].commands["start"]  # type: ignore[attr-defined]


def _parse(group: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """What `pdkv <group> start ARGS` hands its callback (the field names and --background), in
    an environment holding only `env`'s settings."""
    unset: dict[str, str | None] = {
        s.option.env: None for c in CLASSES.values() for s in declared(c)
    }
    with CliRunner().isolation(env={**unset, **(env or {})}):
        ctx = _start(group).make_context("start", list(args))
    params = dict(ctx.params)
    assert params.pop("background") is False
    return params


def _changed(s: Setting, tmp_path: Path) -> Any:
    """A value of `s` other than its default."""
    o = s.option
    if s.type is bool:
        return not s.default
    if o.choices:
        return next(c for c in o.choices if c != s.default)
    if s.type is tuple and o.multiple:  # given once per value: strings
        return (f"{s.name}-a", f"{s.name}-b")
    if s.type is tuple:
        return (1000, 1001)
    if s.type is Path:
        return tmp_path / s.name
    if s.type is int:
        return 2 if s.default is None else s.default + 1
    if s.type is float:
        value = 2.5 if s.default is None else s.default + 1.5
        return value if o.max is None or value <= o.max else o.max / 2  # a share: 0.5
    return f"{s.name}-value"


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _all_changed(role: str, tmp_path: Path) -> dict[str, Any]:
    values = {s.name: _changed(s, tmp_path) for s in declared(CLASSES[role])}
    if role == "api":
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")  # --model must look like one
        values.update(host="127.0.0.2", model=tmp_path / "model")  # loopback: no key needed
    return values


def test_each_command_has_an_option_per_declared_setting() -> None:
    for group, cls in CLASSES.items():
        params = {p.name: p for p in _start(group).params if isinstance(p, click.Option)}
        for s in declared(cls):
            param = params[s.name]
            assert param.opts[0] == s.option.flag and param.envvar == s.option.env, s.name
            assert param.help == s.option.help
            assert param.default == s.default  # the field's default, never one of its own
    decode_flags = {o for p in _start("decode").params for o in p.opts}
    assert "--max-prompt-tokens" not in decode_flags  # declared in the shared base, prefill only
    assert "--max-prompt-tokens" in {o for p in _start("prefill").params for o in p.opts}


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_detached_daemon_gets_every_setting_back(tmp_path: Path, role: str) -> None:
    g = Globals(runtime_dir=tmp_path)
    cfg = make_config(g, role=role, **_all_changed(role, tmp_path))
    argv = background_argv(g, cfg)
    assert argv[argv.index("start") - 1] == role
    parsed = _parse(role, argv[argv.index("start") + 1 :])
    assert make_config(g, role=role, **parsed) == cfg
    assert make_config(g, role=role, **_parse(role, [])) == make_config(g, role=role)


def test_a_detached_api_gets_every_setting_back_but_the_key(tmp_path: Path) -> None:
    values = _all_changed("api", tmp_path)
    cfg = ApiConfig(runtime_dir=tmp_path, **values)
    argv = settings.argv(cfg)
    assert values["api_key"] not in argv  # it travels in the environment
    parsed = _parse("api", argv)
    assert parsed.pop("api_key") is None
    assert ApiConfig(runtime_dir=tmp_path, api_key=cfg.api_key, **parsed) == cfg


@pytest.mark.parametrize("role", ["decode", "prefill", "api"])
def test_every_setting_reads_its_environment_variable(tmp_path: Path, role: str) -> None:
    values = _all_changed(role, tmp_path)
    env = {
        s.option.env: " ".join(values[s.name]) if s.option.multiple else _as_text(values[s.name])
        for s in declared(CLASSES[role])
    }  # a repeatable option's variable holds its values separated by spaces
    assert _parse(role, [], env=env) == values


def test_a_bad_uid_list_is_a_usage_error_naming_the_option(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["--runtime-dir", str(tmp_path), "decode", "start", "--allowed-uids", "1000,me"]
    )
    assert result.exit_code == 2
    assert "--allowed-uids" in result.output and "'1000,me'" in result.output


def test_docs_tables_are_the_declarations() -> None:
    tables = settings_doc.tables_in(OPERATIONS.read_text())
    assert set(tables) == set(settings_doc.TABLES)
    for name, render in settings_doc.TABLES.items():
        assert tables[name] == render(), (
            f"docs/operations.md's '{name}' settings table differs from the declarations: "
            "run `python -m pdkv.settings_doc`"
        )


def _by_flag_and_env() -> dict[tuple[str, str], Setting]:
    return {(s.option.flag, s.option.env): s for cls in CLASSES.values() for s in declared(cls)}


def test_options_the_docs_name_with_a_variable_exist_as_named() -> None:
    """`--flag ...` (`PDKV_X`) anywhere in docs/operations.md (the limits table, the TCP link's
    options) names a declared option with that variable."""
    known = _by_flag_and_env()
    pairs = re.findall(r"`(--[a-z-]+)[^`]*` \(`(PDKV_[A-Z_]+)`\)", OPERATIONS.read_text())
    assert len(pairs) >= 15
    unknown = [p for p in pairs if p not in known]
    assert not unknown, unknown


def test_the_limits_table_states_the_declared_defaults() -> None:
    known = _by_flag_and_env()
    text = OPERATIONS.read_text()
    section = text[text.index("## Limits and timeouts") :]
    section = section[: section.index("\n## ")]
    rows = [ln.split(" | ") for ln in section.splitlines() if ln.startswith("| ") and "`--" in ln]
    assert len(rows) >= 10
    for cells in rows:
        flag, env = re.match(r"`(--[a-z-]+)` \(`(PDKV_[A-Z_]+)`\)", cells[1]).groups()  # type: ignore[union-attr]
        want = settings_doc.default_text(known[(flag, env)])
        assert re.match(re.escape(want) + r"(\D|$)", cells[2]), (flag, cells[2], want)


def test_the_systemd_environment_example_names_only_real_variables() -> None:
    text = (ROOT / "deploy" / "systemd" / "pdkv.env.example").read_text()
    named = set(re.findall(r"^#?(PDKV_[A-Z_]+)=", text, re.M))
    envs = {env for _, env in _by_flag_and_env()}
    not_options = {
        "PDKV_RUNTIME_DIR",
        "PDKV_LOG_FORMAT",
        "PDKV_LOG_LEVEL",
        "PDKV_SHARED_RUNTIME_DIR",
    }
    assert len(named) >= 20
    assert named - envs - not_options == set()


def test_common_declares_settings_without_click() -> None:
    """The declarations are plain data: click stays in pdkv/, the application above common/."""
    for path in (ROOT / "common").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] == "click" for n in names), path


def test_pipelined_forwards_default_by_device_and_the_flag_or_env_overrides() -> None:
    """--pipeline-forwards unset: on for a CPU prefill, off on CUDA (not measured there yet);
    either flag, or PDKV_PIPELINE_FORWARDS, decides on any device."""
    assert PrefillConfig().pipelined("cpu") and PrefillConfig().pipelined("cuda")
    assert not PrefillConfig(pipeline_forwards=False).pipelined("cuda")
    assert PrefillConfig(pipeline_forwards=True).pipelined("cuda")
    assert not PrefillConfig(pipeline_forwards=False).pipelined("cpu")
    seen: list[Any] = []

    @click.command()
    @config_options(PrefillConfig)
    def probe(**kw: Any) -> None:
        seen.append(kw["pipeline_forwards"])

    runner = CliRunner()
    for args, env in (
        ([], {}),
        (["--pipeline-forwards"], {}),
        ([], {"PDKV_PIPELINE_FORWARDS": "0"}),
    ):
        assert runner.invoke(probe, args, env=env).exit_code == 0
    assert seen == [None, True, False]


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_num_blocks_auto_reaches_a_detached_daemon_and_reads_from_the_environment(
    tmp_path: Path, role: str
) -> None:
    g = Globals(runtime_dir=tmp_path)
    cfg = make_config(g, role=role, num_blocks="auto", memory_fraction=0.25)
    argv = background_argv(g, cfg)
    assert argv[argv.index("--num-blocks") + 1] == "auto"
    assert make_config(g, role=role, **_parse(role, argv[argv.index("start") + 1 :])) == cfg
    env = {"PDKV_NUM_BLOCKS": "auto", "PDKV_MEMORY_FRACTION": "0.25"}
    assert make_config(g, role=role, **_parse(role, [], env=env)) == cfg


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--num-blocks", "0"], "positive number of blocks or auto, got '0'"),
        (["--num-blocks", "lots"], "positive number of blocks or auto"),
        (["--memory-fraction", "0"], "--memory-fraction"),
        (["--memory-fraction", "1.5"], "--memory-fraction"),
    ],
)
def test_a_bad_pool_size_is_a_usage_error(tmp_path: Path, args: list[str], says: str) -> None:
    result = CliRunner().invoke(cli, ["--runtime-dir", str(tmp_path), "decode", "start", *args])
    assert result.exit_code == 2, result.output
    assert says in result.output
