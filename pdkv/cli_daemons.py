"""`pdkv decode start` and `pdkv prefill start`: the two daemons' command groups, thin shims over
pdkv/commands.py's start_daemon. Their options are the settings DecodeConfig and PrefillConfig
declare (common/config.py), made click options by cli_options.py."""

from __future__ import annotations

import click

from common.config import DecodeConfig, PrefillConfig
from common.daemon import exit_now
from pdkv import commands
from pdkv.cli_options import daemon_options


@click.group()
def decode() -> None:
    """The decode daemon: imports the prefill pool, pulls KV, decodes with continuous batching."""


@decode.command("start")
@daemon_options(DecodeConfig)
@click.pass_obj
def decode_start(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Start the decode daemon (foreground unless --background)."""
    _exit(commands.start_daemon(g, role="decode", **opts), background=opts["background"])


@click.group()
def prefill() -> None:
    """The prefill daemon: client front door, prefill forward pass, KV handoff to decode."""


@prefill.command("start")
@daemon_options(PrefillConfig)
@click.pass_obj
def prefill_start(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Start the prefill daemon (foreground unless --background)."""
    _exit(commands.start_daemon(g, role="prefill", **opts), background=opts["background"])


def _exit(code: int, *, background: bool) -> None:
    """A foreground daemon has shut down: exit at once (common.daemon.exit_now); the command
    that only detached one exits as any command does."""
    if background:
        raise SystemExit(code)
    exit_now(code)
