"""The options `pdkv`'s commands share: the settings a config class declares (common.settings)
as click options, the global options (accepted before or after the subcommand) and the client
socket. Every option has help text."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from common.settings import Setting, declared
from pdkv import commands

BACKGROUND = click.option(
    "--background", is_flag=True, help="Detach, write a pidfile and a log in the runtime dir."
)


class _Parsed(click.ParamType):
    """Text turned into a field's value by the field's own parser (e.g. a uid list)."""

    name = "text"

    def __init__(self, parse: Callable[[str], Any]) -> None:
        self.parse = parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value  # the field's default
        try:
            return self.parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _click_type(s: Setting) -> click.ParamType:
    o = s.option
    if o.parse is not None:
        return _Parsed(o.parse)
    if o.choices:
        return click.Choice(list(o.choices))
    if s.type is Path:
        return click.Path(path_type=Path)
    if s.type is int and (o.min is not None or o.max is not None):
        return click.IntRange(o.min, o.max, min_open=o.min_open)  # type: ignore[arg-type]
    if s.type is float and (o.min is not None or o.max is not None):
        return click.FloatRange(o.min, o.max, min_open=o.min_open)
    return {int: click.INT, float: click.FLOAT, str: click.STRING}[s.type]


def setting_option(s: Setting) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The click option of one declared setting; its parameter is the field's name."""
    o = s.option
    kw: dict[str, Any] = {
        "envvar": o.env,
        "show_envvar": True,
        "default": s.default,
        "show_default": o.show_default,
        "metavar": o.metavar,
        "help": o.help,
    }
    if s.type is bool and o.negatable:
        return click.option(f"{o.flag}/{o.no_flag}", s.name, **kw)
    if s.type is bool:
        return click.option(o.flag, s.name, is_flag=True, **kw)
    if o.multiple:  # click gives a tuple; its environment variable splits on whitespace
        return click.option(o.flag, s.name, multiple=True, type=click.STRING, **kw)
    return click.option(o.flag, s.name, type=_click_type(s), **kw)


def config_options(cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A command's options, one per setting `cls` declares, in field order (common.settings)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for s in reversed(declared(cls)):
            fn = setting_option(s)(fn)
        return fn

    return decorate


def daemon_options(cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`pdkv <role> start`'s options: the global ones, the settings of `cls`, --background."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        return global_options(config_options(cls)(BACKGROUND(fn)))

    return decorate


LOG_FORMATS = click.Choice(["auto", "console", "json"])
LOG_LEVEL_HELP = "debug, info, warning or error."
RUNTIME_DIR_HELP = "Sockets, pidfiles and logs live here (created 0700)."


def _override_global(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A global option given after the subcommand replaces the one given (or defaulted) before."""
    if value is not None and param.name is not None:
        ctx.obj = dataclasses.replace(ctx.find_object(commands.Globals), **{param.name: value})
    return value


def global_options(fn):  # type: ignore[no-untyped-def]
    """--runtime-dir, --log-format and --log-level on a subcommand too (`pdkv status
    --runtime-dir X`); their environment variables are read once, by the top-level group."""
    late = {"callback": _override_global, "expose_value": False, "allow_from_autoenv": False}
    fn = click.option("--log-level", help=LOG_LEVEL_HELP, **late)(fn)
    fn = click.option(
        "--log-format", type=LOG_FORMATS, help="auto: console on a terminal.", **late
    )(fn)
    return click.option(
        "--runtime-dir",
        type=click.Path(path_type=Path),
        help=RUNTIME_DIR_HELP + " [env var: PDKV_RUNTIME_DIR]",
        **late,
    )(fn)


CLIENT_SOCKET = click.option(
    "--client-socket",
    show_envvar=True,
    envvar="PDKV_CLIENT_SOCKET",
    default=None,
    type=click.Path(path_type=Path),
    help="The prefill daemon's client socket [default: RUNTIME_DIR/prefill.sock].",
)
