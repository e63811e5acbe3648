"""Settings declared once: a config dataclass field names its command-line option in its metadata.

    drain_timeout_s: float = field(default=10.0, metadata=opt("--drain-timeout", help="..."))

The field gives the name, type and default; `opt` gives the flag users type (which may drop the
field's unit suffix), its PDKV_* environment variable, help text and value range. pdkv's
cli_options turns these into click options and settings_doc into docs/operations.md's tables;
`argv` writes a config back as a command line. Plain data: nothing here imports click.
"""

from __future__ import annotations

import dataclasses
import socket
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any

ENV_PREFIX = "PDKV_"
_KEY = "pdkv.option"


@dataclass(frozen=True, kw_only=True)
class Option:
    """How one field is given from outside: flag, environment variable, help, accepted values."""

    flag: str  # "--drain-timeout"
    help: str
    env: str  # "PDKV_DRAIN_TIMEOUT"
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    min: float | None = None  # a number below is a usage error
    max: float | None = None
    min_open: bool = False  # min itself is refused too
    # True: show the default in --help; a string: the default in words (one computed at start)
    show_default: bool | str = True
    negatable: bool = False  # a bool field that is on by default: --x / --no-x
    multiple: bool = False  # a tuple[str, ...] field given once per value: --x A --x B
    parse: Callable[[str], Any] | None = None  # the text given to the field's value
    secret: bool = False  # never written on a command line (other users can read it there)
    only: str | None = None  # the one role (a config's `role`) taking a field of a shared base

    @property
    def no_flag(self) -> str:
        """The flag turning a negatable option off: --no-early-handoff."""
        return "--no-" + self.flag.removeprefix("--")


def opt(flag: str, *, help: str, env: str | None = None, **kw: Any) -> dict[str, Option]:
    """Field metadata declaring the option `flag`; its environment variable is PDKV_ and the flag
    in capitals (--drain-timeout: PDKV_DRAIN_TIMEOUT) unless `env` names another."""
    env = env or ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()
    return {_KEY: Option(flag=flag, help=help, env=env, **kw)}


@dataclass(frozen=True)
class Setting:
    """One declared field of a config class: name, value type (None stripped), default, option."""

    name: str
    type: type
    default: Any
    option: Option


def declared(cls: type) -> list[Setting]:
    """The fields of `cls` that declare an option, in field order; a field declared `only` for a
    role is left out of a config whose `role` differs."""
    hints = typing.get_type_hints(cls)
    role = getattr(cls, "role", None)
    out = []
    for f in dataclasses.fields(cls):
        option = f.metadata.get(_KEY)
        if option is None or (option.only is not None and option.only != role):
            continue
        out.append(Setting(f.name, _value_type(hints[f.name]), f.default, option))
    return out


def _value_type(hint: Any) -> type:
    """int, float, str, bool, Path or tuple: `hint` without its `| None`, its Literal words (which
    the option's `parse` accepts beside the type's values: `int | Literal["auto"]`) and its type
    arguments."""
    if isinstance(hint, UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [
            a
            for a in typing.get_args(hint)
            if a is not type(None) and typing.get_origin(a) is not typing.Literal
        ]
    origin = typing.get_origin(hint) or hint
    if origin not in (int, float, str, bool, Path, tuple):
        raise TypeError(f"a declared setting cannot be of type {hint!r}")
    return origin


def instance_name(given: str | None, role: str, where: object) -> str:
    """A process's name in `pdkv status` and as /metrics' `pdkv_instance` label: `given` (its
    --instance), else ROLE@HOSTNAME:WHERE (WHERE: the runtime dir of a daemon, the port of the
    API), unique on a host and stable across restarts."""
    return given or f"{role}@{socket.gethostname()}:{where}"


def int_tuple(text: str) -> tuple[int, ...]:
    """'1000,1001' as (1000, 1001), blank items skipped: a tuple field's text (`argv` writes it)."""
    try:
        return tuple(int(u) for u in text.split(",") if u.strip())
    except ValueError:
        raise ValueError(f"wants comma-separated integers, got {text!r}") from None


def argv(cfg: Any) -> list[str]:
    """The options that give a process started with them `cfg`'s declared settings: every value
    set (an unset one, None or empty, is what that process finds in the same environment too),
    both states of a negatable flag, no secret."""
    out: list[str] = []
    for s in declared(type(cfg)):
        value, o = getattr(cfg, s.name), s.option
        if o.secret or value is None or value == ():
            continue
        if s.type is bool:
            if o.negatable:
                out.append(o.flag if value else o.no_flag)
            elif value:
                out.append(o.flag)
            continue
        if o.multiple:
            out += [part for item in value for part in (o.flag, str(item))]
            continue
        out += [o.flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return out
