"""`pdkv decode start` and `pdkv prefill start`: the two daemons' command groups, thin shims over
pdkv/commands.py's start_daemon. Their options are the settings DecodeConfig and PrefillConfig
declare (prefill_server/config.py, decode_server/config.py), made click options by cli_options.py."""

from __future__ import annotations

import click

from decode_server.config import DecodeConfig
from pdkv import commands
from pdkv.cli_options import daemon_options
from prefill_server.config import PrefillConfig


@click.group()
def decode() -> None:
    """The decode daemon: imports the prefill pool, pulls KV, decodes with continuous batching."""


@decode.command("start")
@daemon_options(DecodeConfig)
@click.pass_obj
def decode_start(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Start the decode daemon (foreground unless --background)."""
    raise SystemExit(commands.start_daemon(g, role="decode", exit_when_done=True, **opts))


@click.group()
def prefill() -> None:
    """The prefill daemon: client front door, prefill forward pass, KV handoff to decode."""


@prefill.command("start")
@daemon_options(PrefillConfig)
@click.pass_obj
def prefill_start(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Start the prefill daemon (foreground unless --background)."""
    raise SystemExit(commands.start_daemon(g, role="prefill", exit_when_done=True, **opts))
