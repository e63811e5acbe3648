"""`pdkv api start`: the HTTP API's command group, a thin shim over pdkv/commands.py's
start_api."""

from __future__ import annotations

from pathlib import Path

import click

from pdkv import commands
from pdkv.cli_options import global_options


@click.group()
def api() -> None:
    """The OpenAI-compatible HTTP API and Prometheus metrics, in front of the prefill daemon."""


@api.command("start")
@click.option(
    "--host",
    show_envvar=True,
    envvar="PDKV_API_HOST",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on; one other than loopback needs --api-key.",
)
@click.option(
    "--port",
    show_envvar=True,
    envvar="PDKV_API_PORT",
    default=8000,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="TCP port to listen on (0: any free port).",
)
@click.option(
    "--api-key",
    show_envvar=True,
    envvar="PDKV_API_KEY",
    default=None,
    help="Clients must send `Authorization: Bearer KEY` to /v1/*.",
)
@click.option(
    "--model",
    show_envvar=True,
    envvar="PDKV_MODEL",
    default=None,
    metavar="DIR",
    type=click.Path(path_type=Path),
    help="The daemons' checkpoint dir, for its chat template and name; default: tiny model.",
)
@click.option(
    "--served-model-name",
    show_envvar=True,
    envvar="PDKV_SERVED_MODEL_NAME",
    default=None,
    help="Model id in /v1/models and requests [default: the checkpoint dir's name, or pdkv-tiny].",
)
@click.option(
    "--client-socket",
    show_envvar=True,
    envvar="PDKV_CLIENT_SOCKET",
    default=None,
    type=click.Path(path_type=Path),
    help="The prefill daemon's client socket.",
)
@click.option(
    "--link-socket",
    show_envvar=True,
    envvar="PDKV_LINK_SOCKET",
    default=None,
    type=click.Path(path_type=Path),
    help="The decode daemon's socket (for health and metrics).",
)
@click.option(
    "--request-timeout",
    show_envvar=True,
    envvar="PDKV_API_REQUEST_TIMEOUT",
    default=120.0,
    show_default=True,
    type=click.FloatRange(0.0, min_open=True),
    help="Seconds to wait for each answer from the daemons before a 504.",
)
@click.option(
    "--drain-timeout",
    show_envvar=True,
    envvar="PDKV_DRAIN_TIMEOUT",
    default=10.0,
    show_default=True,
    type=float,
    help="Seconds to finish open responses on SIGTERM.",
)
@click.option(
    "--background", is_flag=True, help="Detach, write a pidfile and a log in the runtime dir."
)
@global_options
@click.pass_obj
def api_start(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Start the HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    raise SystemExit(commands.start_api(g, **opts))
