"""`pdkv` command line: a thin click shim over keyword-only functions (see common/commands.py).

Every option can also come from a PDKV_* environment variable (named in --help). Exit codes:
0 success, 1 failure, 2 usage error, 3 startup failure (e.g. socket owned by a live daemon).
"""

from __future__ import annotations

from pathlib import Path

import click

from common.app import commands
from common.rundir import default_runtime_dir

_DAEMON_OPTIONS = [
    click.option(
        "--model",
        show_envvar=True,
        envvar="PDKV_MODEL",
        default=None,
        metavar="DIR",
        help="Hugging Face checkpoint dir (config.json + *.safetensors); default: built-in tiny model.",
    ),
    click.option(
        "--device",
        show_envvar=True,
        envvar="PDKV_DEVICE",
        default="auto",
        show_default=True,
        help="auto, cpu or cuda:N (auto: cuda:0 when CUDA works, else cpu).",
    ),
    click.option(
        "--dtype",
        show_envvar=True,
        envvar="PDKV_DTYPE",
        default=None,
        help="Model and KV dtype (float32, bfloat16, float16); default float32 on CPU, bfloat16 on CUDA.",
    ),
    click.option(
        "--ipc-backend",
        show_envvar=True,
        envvar="PDKV_IPC_BACKEND",
        default="auto",
        show_default=True,
        type=click.Choice(["auto", "shm", "cuda-raw", "cuda-torch"]),
    ),
    click.option(
        "--num-blocks",
        show_envvar=True,
        envvar="PDKV_NUM_BLOCKS",
        default=1024,
        show_default=True,
        type=click.IntRange(1),
        help="KV pool size in blocks.",
    ),
    click.option(
        "--block-size",
        show_envvar=True,
        envvar="PDKV_BLOCK_SIZE",
        default=16,
        show_default=True,
        type=click.IntRange(1),
        help="Tokens per KV block (must match on both daemons).",
    ),
    click.option(
        "--link-socket",
        show_envvar=True,
        envvar="PDKV_LINK_SOCKET",
        default=None,
        type=click.Path(path_type=Path),
        help="The decode daemon's link socket [default: RUNTIME_DIR/decode.sock].",
    ),
    click.option(
        "--socket-group",
        show_envvar=True,
        envvar="PDKV_SOCKET_GROUP",
        default=None,
        help="Make sockets 0660 owned by this group (default 0600).",
    ),
    click.option(
        "--allowed-uids",
        show_envvar=True,
        envvar="PDKV_ALLOWED_UIDS",
        default="",
        help="Comma-separated uids allowed to connect besides our own.",
    ),
    click.option(
        "--torch-threads",
        show_envvar=True,
        envvar="PDKV_TORCH_THREADS",
        default=0,
        type=click.IntRange(0),
        help="CPU threads for torch (0: 1 for the tiny model, torch's default otherwise).",
    ),
    click.option(
        "--spin-us",
        show_envvar=True,
        envvar="PDKV_SPIN_US",
        default=0,
        show_default=True,
        type=click.IntRange(0, 100_000),
        help="After a handoff, poll the link this many µs without sleeping: lower latency for "
        "back-to-back handoffs on a host with idle cores, worse on a busy one (0: off).",
    ),
    click.option(
        "--drain-timeout",
        show_envvar=True,
        envvar="PDKV_DRAIN_TIMEOUT",
        default=10.0,
        show_default=True,
        type=float,
        help="Seconds to finish in-flight work on SIGTERM.",
    ),
    click.option(
        "--heartbeat-timeout",
        show_envvar=True,
        envvar="PDKV_HEARTBEAT_TIMEOUT",
        default=5.0,
        show_default=True,
        type=float,
        help="A link silent this long is dead.",
    ),
    click.option(
        "--background", is_flag=True, help="Detach, write a pidfile and a log in the runtime dir."
    ),
]


def daemon_options(fn):  # type: ignore[no-untyped-def]
    for opt in reversed(_DAEMON_OPTIONS):
        fn = opt(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option(
    "--runtime-dir",
    show_envvar=True,
    envvar="PDKV_RUNTIME_DIR",
    type=click.Path(path_type=Path),
    default=default_runtime_dir,
    show_default="$XDG_RUNTIME_DIR/pdkv or /tmp/pdkv-$UID",
    help="Sockets, pidfiles and logs live here (created 0700).",
)
@click.option(
    "--log-format",
    show_envvar=True,
    envvar="PDKV_LOG_FORMAT",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "console", "json"]),
    help="auto: console on a terminal, JSON otherwise.",
)
@click.option(
    "--log-level", show_envvar=True, envvar="PDKV_LOG_LEVEL", default="INFO", show_default=True
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


@cli.group()
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
@click.pass_obj
def decode_start(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Start the decode daemon (foreground unless --background)."""
    raise SystemExit(commands.start_daemon(g, role="decode", **opts))


@cli.group()
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
    help="Seconds a request may wait for blocks, the link, or decode capacity.",
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
    "--max-prompt-tokens",
    show_envvar=True,
    envvar="PDKV_MAX_PROMPT_TOKENS",
    default=8192,
    show_default=True,
    type=click.IntRange(1, 262_144),
    help="Longest prompt accepted; longer ones get BAD_REQUEST.",
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
@click.pass_obj
def prefill_start(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Start the prefill daemon (foreground unless --background)."""
    raise SystemExit(commands.start_daemon(g, role="prefill", **opts))


@cli.command()
@click.argument("which", type=click.Choice(["prefill", "decode", "all"]), default="all")
@click.option(
    "--timeout", default=30.0, show_default=True, help="Seconds to wait for each daemon to exit."
)
@click.pass_obj
def stop(g: commands.Globals, which: str, timeout: float) -> None:
    """Stop daemons started with --background (SIGTERM, graceful drain)."""
    raise SystemExit(commands.stop(g, which=which, timeout=timeout))


@cli.command()
@click.option(
    "--client-socket",
    show_envvar=True,
    envvar="PDKV_CLIENT_SOCKET",
    default=None,
    type=click.Path(path_type=Path),
)
@click.option(
    "--link-socket",
    show_envvar=True,
    envvar="PDKV_LINK_SOCKET",
    default=None,
    type=click.Path(path_type=Path),
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def status(
    g: commands.Globals, client_socket: Path | None, link_socket: Path | None, as_json: bool
) -> None:
    """Show whether each daemon is up, its pool use, in-flight requests and link state.

    Exit 0 when both daemons are up, 1 otherwise.
    """
    raise SystemExit(
        commands.status(g, client_socket=client_socket, link_socket=link_socket, as_json=as_json)
    )


@cli.command()
@click.argument("prompt")
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(1))
@click.option(
    "--temperature", default=0.0, show_default=True, type=click.FloatRange(0.0), help="0 = greedy."
)
@click.option(
    "--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True)
)
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0), help="0 = off.")
@click.option("--seed", default=None, type=int, help="Makes sampling reproducible.")
@click.option("--ignore-eos", is_flag=True, help="Generate max-tokens tokens even past EOS.")
@click.option(
    "--stream/--no-stream", default=True, show_default=True, help="Print text as it arrives."
)
@click.option(
    "--client-socket",
    show_envvar=True,
    envvar="PDKV_CLIENT_SOCKET",
    default=None,
    type=click.Path(path_type=Path),
)
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to wait for the answer.")
@click.pass_obj
def generate(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Generate a completion of PROMPT through the running daemons."""
    raise SystemExit(commands.generate(g, **opts))


@cli.command()
@click.option(
    "--prompts",
    "num_prompts",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="How many prompts to run concurrently.",
)
@click.option("--max-tokens", default=24, show_default=True, type=click.IntRange(1))
@click.option("--device", show_envvar=True, envvar="PDKV_DEVICE", default="auto", show_default=True)
@click.option("--model", show_envvar=True, envvar="PDKV_MODEL", default=None, metavar="DIR")
@click.pass_obj
def demo(g: commands.Globals, **opts) -> None:  # type: ignore[no-untyped-def]
    """Start the pair on temporary sockets, run prompts, check them against the reference, stop."""
    raise SystemExit(commands.demo(g, **opts))


def main() -> None:
    cli(prog_name="pdkv", auto_envvar_prefix="PDKV")  # e.g. PDKV_GENERATE_MAX_TOKENS


if __name__ == "__main__":
    main()
