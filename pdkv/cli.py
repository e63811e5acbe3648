"""`pdkv` command line: a thin click shim over keyword-only functions (see pdkv/commands.py
and client_commands.py).

This module holds the root group, its global options and the single commands (stop, status,
generate, demo); the daemons' groups live in cli_daemons.py and the API's in cli_api.py.

Every option can also come from a PDKV_* environment variable (named in --help). The global
options (--runtime-dir, --log-format, --log-level) are accepted before or after the subcommand.
Exit codes (docs/operations.md): 0 success, 1 failure (`status`: not healthy), 2 usage error,
3 startup failure (bad --model/--device/--dtype, socket owned by a live daemon).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import click

from common.daemon.rundir import default_runtime_dir
from pdkv import client_commands, commands
from pdkv.cli_api import api
from pdkv.cli_daemons import decode, prefill
from pdkv.cli_model import model
from pdkv.cli_options import (
    CLIENT_SOCKET,
    LOG_FORMATS,
    LOG_LEVEL_HELP,
    RUNTIME_DIR_HELP,
    global_options,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(metadata.version("pdkv"), "--version", "-V", prog_name="pdkv")
@click.option(
    "--runtime-dir",
    show_envvar=True,
    envvar="PDKV_RUNTIME_DIR",
    type=click.Path(path_type=Path),
    default=default_runtime_dir,
    show_default="$XDG_RUNTIME_DIR/pdkv or /tmp/pdkv-$UID",
    help=RUNTIME_DIR_HELP,
)
@click.option(
    "--log-format",
    show_envvar=True,
    envvar="PDKV_LOG_FORMAT",
    default="auto",
    show_default=True,
    type=LOG_FORMATS,
    help="auto: console on a terminal, JSON otherwise.",
)
@click.option(
    "--log-level",
    show_envvar=True,
    envvar="PDKV_LOG_LEVEL",
    default="INFO",
    show_default=True,
    help=LOG_LEVEL_HELP,
)
@click.pass_context
def cli(ctx: click.Context, runtime_dir: Path, log_format: str, log_level: str) -> None:
    """pdkv: disaggregated prefill/decode daemons with a fast KV-cache handoff.

    \b
    Quick start (CPU or GPU):
      pdkv decode start --background
      pdkv prefill start --background
      pdkv generate "Hello"
      pdkv status
      pdkv stop
    Or everything at once, checked against the single-process reference:  pdkv demo
    """
    ctx.obj = commands.Globals(runtime_dir=runtime_dir, log_format=log_format, log_level=log_level)


cli.add_command(decode)
cli.add_command(prefill)
cli.add_command(api)
cli.add_command(model)


@cli.command()
@click.argument("which", type=click.Choice(["prefill", "decode", "api", "all"]), default="all")
@click.option(
    "--timeout", default=30.0, show_default=True, help="Seconds to wait for each daemon to exit."
)
@click.option(
    "--port",
    default=None,
    type=click.IntRange(1, 65535),
    help="With WHICH api: only the API on this port [default: every API in the runtime dir].",
)
@global_options
@click.pass_obj
def stop(g: commands.Globals, which: str, timeout: float, port: int | None) -> None:
    """Stop WHICH (no WHICH: all, both daemons and every API), started with --background.

    Each gets SIGTERM: a graceful drain, then exit.
    """
    if port is not None and which != "api":
        raise click.UsageError("--port goes with WHICH api")
    raise SystemExit(commands.stop(g, which=which, timeout=timeout, port=port))


@cli.command()
@CLIENT_SOCKET
@click.option(
    "--link-socket",
    show_envvar=True,
    envvar="PDKV_LINK_SOCKET",
    default=None,
    type=click.Path(path_type=Path),
    help="The decode daemon's link socket [default: RUNTIME_DIR/decode.sock].",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.argument("dirs", nargs=-1, type=click.Path(path_type=Path, file_okay=False))
@global_options
@click.pass_obj
def status(
    g: commands.Globals,
    client_socket: Path | None,
    link_socket: Path | None,
    as_json: bool,
    dirs: tuple[Path, ...],
) -> None:
    """Show each daemon's model, pool use, requests and throughput, and the link between them.

    Exit 0 only when the daemons whose sockets are in the runtime dir (one at least) answer and
    are linked to the other kind: the prefill's link to a decode up (that decode's socket may
    be elsewhere, --decode), the decode linked from a prefill. 1 otherwise (a daemon down, or
    the link down, e.g. mismatched --block-size): usable as a health check.

    With DIRS (runtime dirs: one per daemon in a deployment of several), every daemon whose
    socket is in one of them; exit 0 only when each dir passes the same rule.
    """
    if dirs:
        raise SystemExit(client_commands.status_of_dirs(list(dirs), as_json=as_json))
    raise SystemExit(
        client_commands.status(
            g, client_socket=client_socket, link_socket=link_socket, as_json=as_json
        )
    )


@cli.command()
@click.argument("prompt", required=False)
@click.option(
    "--prompt-file",
    type=click.File("r", encoding="utf-8"),
    help="Read the prompt from this file ('-': standard input) instead of PROMPT.",
)
@click.option(
    "--max-tokens",
    default=32,
    show_default=True,
    type=click.IntRange(1),
    help="Most tokens to generate.",
)
@click.option(
    "--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0), help="0 = greedy."
)
@click.option(
    "--top-p",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.0, 1.0, min_open=True),
    help="Nucleus sampling: keep the most likely tokens whose probabilities sum to this.",
)
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0), help="0 = off.")
@click.option("--seed", default=None, type=int, help="Makes sampling reproducible.")
@click.option("--ignore-eos", is_flag=True, help="Generate max-tokens tokens even past EOS.")
@click.option(
    "--chat",
    is_flag=True,
    help="PROMPT is a user message: send it in the model's chat template, as the API's "
    "/v1/chat/completions does.",
)
@click.option("--system", default=None, help="With --chat: a system message before PROMPT.")
@click.option(
    "--stream/--no-stream", default=True, show_default=True, help="Print text as it arrives."
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object: request id, token ids, text, finish reason, usage and timings "
    "(ttft_ms, handoff_us, total_ms, ...); text is printed exactly, control characters included.",
)
@CLIENT_SOCKET
@click.option(
    "--timeout",
    default=120.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to wait for each part of the answer.",
)
@global_options
@click.pass_obj
def generate(g: commands.Globals, prompt: str | None, prompt_file: Any, **opts: Any) -> None:
    """Generate a completion of PROMPT through the running daemons.

    PROMPT '-' (or --prompt-file -) reads the prompt from standard input. Control characters in
    the generated text are shown escaped (e.g. \\x1b) unless --json is given.

    With --chat, PROMPT is a user message, sent in the model's chat template:

    \b
      pdkv generate --chat "What is the capital of France?"
    """
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give a PROMPT ('-': standard input) or --prompt-file, not both")
    if opts["system"] is not None and not opts["chat"]:
        raise click.UsageError("--system needs --chat")
    if prompt == "-":
        prompt = click.get_text_stream("stdin").read()
    elif prompt_file is not None:
        prompt = prompt_file.read()
    raise SystemExit(client_commands.generate(g, prompt=prompt, **opts))


@cli.command()
@click.option(
    "--prompts",
    "num_prompts",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="How many prompts to run concurrently.",
)
@click.option(
    "--max-tokens",
    default=24,
    show_default=True,
    type=click.IntRange(1),
    help="Tokens generated per prompt.",
)
@click.option(
    "--device",
    show_envvar=True,
    envvar="PDKV_DEVICE",
    default="auto",
    show_default=True,
    help="auto, cpu or cuda:N, for both daemons and the reference.",
)
@click.option(
    "--decode-device",
    default=None,
    metavar="DEVICE",
    help="The decode daemon's device, e.g. cuda:1 for a pair on two GPUs [default: --device].",
)
@click.option(
    "--model",
    show_envvar=True,
    envvar="PDKV_MODEL",
    default=None,
    metavar="DIR",
    help="Hugging Face checkpoint dir; default: the built-in tiny model (random weights).",
)
@global_options
@click.pass_obj
def demo(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Start the pair on temporary sockets, run prompts, check them against the reference, stop."""
    raise SystemExit(commands.demo(g, **opts))


def main() -> None:
    cli(prog_name="pdkv", auto_envvar_prefix="PDKV")  # e.g. PDKV_GENERATE_MAX_TOKENS


if __name__ == "__main__":
    main()
