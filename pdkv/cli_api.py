"""`pdkv api start`: the HTTP API's command group, a thin shim over pdkv/commands.py's
start_api. Its options are the settings ApiConfig declares (api_server/config.py)."""

from __future__ import annotations

import click

from api_server.config import ApiConfig
from pdkv import commands
from pdkv.cli_options import BACKGROUND, config_options, global_options


@click.group()
def api() -> None:
    """The OpenAI-compatible HTTP API and Prometheus metrics, in front of the prefill daemon."""


@api.command("start")
@config_options(ApiConfig)
@BACKGROUND
@global_options
@click.pass_obj
def api_start(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Start the HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    raise SystemExit(commands.start_api(g, **opts))
