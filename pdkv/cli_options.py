"""The options `pdkv`'s commands share: the daemons' settings, the global options (accepted
before or after the subcommand) and the client socket. Every option has help text."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click

from pdkv import commands

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
        help="Model and KV dtype: float32, bfloat16 or float16 (fp32, bf16, fp16 too); "
        "default float32 on CPU, bfloat16 on CUDA.",
    ),
    click.option(
        "--allow-byte-tokenizer",
        show_envvar=True,
        envvar="PDKV_ALLOW_BYTE_TOKENIZER",
        is_flag=True,
        help="Load a --model without tokenizer.json with UTF-8 bytes as token ids (its text is "
        "garbage unless the model was trained on bytes); without this flag such a model is refused.",
    ),
    click.option(
        "--ipc-backend",
        show_envvar=True,
        envvar="PDKV_IPC_BACKEND",
        default="auto",
        show_default=True,
        type=click.Choice(["auto", "shm", "cuda-raw", "cuda-torch"]),
        help="How the KV pool is shared: shm (CPU memfd), cuda-raw (the extension), cuda-torch "
        "(torch storage IPC); auto picks by device.",
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
        "--max-connections",
        show_envvar=True,
        envvar="PDKV_MAX_CONNECTIONS",
        default=1024,
        show_default=True,
        type=click.IntRange(1),
        help="Most open connections on the daemon's socket; more are refused with NO_CAPACITY.",
    ),
    click.option(
        "--frame-timeout",
        show_envvar=True,
        envvar="PDKV_FRAME_TIMEOUT",
        default=30.0,
        show_default=True,
        type=click.FloatRange(0.1),
        help="Seconds a frame may take to arrive whole; a slower sender is disconnected.",
    ),
    click.option(
        "--link-key-file",
        show_envvar=True,
        envvar="PDKV_LINK_KEY_FILE",
        default=None,
        type=click.Path(path_type=Path),
        help="Shared secret (mode 0600, ≥ 16 bytes) both daemons prove in HELLO on a TCP link; "
        "required with --listen / --decode tcp://.",
    ),
    click.option(
        "--background", is_flag=True, help="Detach, write a pidfile and a log in the runtime dir."
    ),
]


def daemon_options(fn):  # type: ignore[no-untyped-def]
    for opt in reversed(_DAEMON_OPTIONS):
        fn = opt(fn)
    return global_options(fn)


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
