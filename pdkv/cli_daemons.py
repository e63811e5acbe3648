"""`pdkv decode start` and `pdkv prefill start`: the two daemons' command groups, thin shims over
pdkv/commands.py's start_daemon (the options they share live in cli_options.py)."""

from __future__ import annotations

from pathlib import Path

import click

from pdkv import commands
from pdkv.cli_options import daemon_options


@click.group()
def decode() -> None:
    """The decode daemon: imports the prefill pool, pulls KV, decodes with continuous batching."""


@decode.command("start")
@daemon_options
@click.option(
    "--max-batch",
    show_envvar=True,
    envvar="PDKV_MAX_BATCH",
    default=64,
    show_default=True,
    type=click.IntRange(1),
    help="Most sequences decoded in one step.",
)
@click.option(
    "--listen",
    show_envvar=True,
    envvar="PDKV_LISTEN",
    default=None,
    metavar="tcp://ADDR:PORT",
    help="Also accept links from prefill daemons on other hosts here (an explicit bind address; "
    "the KV moves with NIXL; needs --link-key-file and pdkv[nixl]). The Unix socket stays.",
)
@click.pass_obj
def decode_start(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Start the decode daemon (foreground unless --background)."""
    raise SystemExit(commands.start_daemon(g, role="decode", **opts))


@click.group()
def prefill() -> None:
    """The prefill daemon: client front door, prefill forward pass, KV handoff to decode."""


@prefill.command("start")
@daemon_options
@click.option(
    "--client-socket",
    show_envvar=True,
    envvar="PDKV_CLIENT_SOCKET",
    default=None,
    type=click.Path(path_type=Path),
    help="Where clients connect [default: RUNTIME_DIR/prefill.sock].",
)
@click.option(
    "--lease-timeout",
    show_envvar=True,
    envvar="PDKV_LEASE_TIMEOUT",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds the decode may hold a request's blocks before RELEASE.",
)
@click.option(
    "--handoff-timeout",
    show_envvar=True,
    envvar="PDKV_HANDOFF_TIMEOUT",
    default=30.0,
    show_default=True,
    type=float,
    help="Seconds a request may wait for free blocks, decode capacity or a dropped link to come "
    "back (a link that never came up or was refused fails it at the next failed reconnect).",
)
@click.option(
    "--max-pending",
    show_envvar=True,
    envvar="PDKV_MAX_PENDING",
    default=1024,
    show_default=True,
    type=click.IntRange(1),
    help="Most requests in flight in the prefill daemon; more get NO_CAPACITY at once.",
)
@click.option(
    "--client-idle-timeout",
    show_envvar=True,
    envvar="PDKV_CLIENT_IDLE_TIMEOUT",
    default=300.0,
    show_default=True,
    type=click.FloatRange(0.1),
    help="Seconds a client connection may stay open with no request in flight and no frame sent.",
)
@click.option(
    "--client-write-timeout",
    show_envvar=True,
    envvar="PDKV_CLIENT_WRITE_TIMEOUT",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0.1),
    help="Seconds a client may leave its stream unread; then its requests are aborted.",
)
@click.option(
    "--max-prompt-tokens",
    show_envvar=True,
    envvar="PDKV_MAX_PROMPT_TOKENS",
    default=8192,
    show_default=True,
    type=click.IntRange(1, 262_144),
    help="Longest prompt accepted; longer ones get BAD_REQUEST.",
)
@click.option(
    "--max-prefill-tokens",
    show_envvar=True,
    envvar="PDKV_MAX_PREFILL_TOKENS",
    default=None,
    type=click.IntRange(1),
    help="Most prompt tokens prefilled in one forward: prompts that arrive while a forward runs "
    "share the next one up to this (a longer prompt runs alone). 1: one prompt per forward "
    "[default: 8192 on CUDA, 1 on CPU, where a forward costs about its tokens].",
)
@click.option(
    "--event-slots",
    show_envvar=True,
    envvar="PDKV_EVENT_SLOTS",
    default=64,
    show_default=True,
    type=click.IntRange(1, 1024),
    help="CUDA: interprocess events in the handoff ring (handoffs in flight at once).",
)
@click.option(
    "--early-handoff/--no-early-handoff",
    show_envvar=True,
    envvar="PDKV_EARLY_HANDOFF",
    default=True,
    show_default=True,
    help="Send each HANDOFF when its prompt is queued for the forward, so the decode checks it, "
    "reserves its blocks and prepares the pull while the prefill computes; the first token "
    "follows in a TOKENS frame that starts the pull. Off: HANDOFF after the first token. TCP "
    "links never hand off early.",
)
@click.option(
    "--decode",
    show_envvar=True,
    envvar="PDKV_DECODE",
    default=None,
    metavar="tcp://HOST:PORT",
    help="Link to a decode daemon on another host instead of the local socket (the KV moves "
    "with NIXL; needs --link-key-file and pdkv[nixl]).",
)
@click.option(
    "--transfer",
    show_envvar=True,
    envvar="PDKV_TRANSFER",
    default="push",
    show_default=True,
    type=click.Choice(["push", "pull"]),
    help="How a TCP link moves the KV: push (the prefill WRITEs into the decode's blocks) or "
    "pull (the decode READs the prefill's); see docs/operations.md for which is faster where.",
)
@click.pass_obj
def prefill_start(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Start the prefill daemon (foreground unless --background)."""
    raise SystemExit(commands.start_daemon(g, role="prefill", **opts))
