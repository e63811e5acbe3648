"""What the CLI's daemon commands do: start and stop the daemons, the API and the demo, as keyword-
only functions returning exit codes (tests call them too). status and generate, which talk to the
running daemons as a client, live in client_commands.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from common import client, settings
from common.daemon import logs
from common.daemon.rundir import StartupError, ensure_runtime_dir, pid_alive, read_pid, remove_file
from common.errors import PdkvError
from decode_server.config import DecodeConfig
from prefill_server.config import PrefillConfig

EXIT_OK, EXIT_FAIL, EXIT_STARTUP = 0, 1, 3
CONFIGS: dict[str, type[DecodeConfig | PrefillConfig]] = {
    "decode": DecodeConfig,
    "prefill": PrefillConfig,
}


@dataclass(frozen=True, kw_only=True)
class Globals:
    runtime_dir: Path
    log_format: str = "auto"
    log_level: str = "INFO"


def make_config(g: Globals, *, role: str, **opts: Any) -> DecodeConfig | PrefillConfig:
    """The config of the `role` daemon from its settings, named as the config's fields (the
    parameters of `pdkv <role> start`)."""
    return CONFIGS[role](runtime_dir=g.runtime_dir, **opts)


def start_daemon(
    g: Globals, *, role: str, background: bool = False, exit_when_done: bool = False, **opts: Any
) -> int:
    """Run a daemon in the foreground, or detach it and return once it answers STATUS.

    `exit_when_done` (the CLI's foreground start, never a test process): once the daemon has
    run and shut down, end the process at once with its exit code (common.daemon.lifecycle.exit_now); a
    start that fails before it runs returns its code as usual."""
    try:
        cfg = make_config(g, role=role, **opts)
        ensure_runtime_dir(cfg.runtime_dir)
    except (PdkvError, OSError) as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_STARTUP
    if background:
        return _start_background(g, cfg)
    logs.configure(g.log_format, g.log_level)  # type: ignore[arg-type]
    from common.daemon import lifecycle

    try:
        if role == "decode":
            from decode_server.server import serve
        else:
            from prefill_server.server import serve
        code = lifecycle.run(lambda: serve(cfg))  # type: ignore[arg-type]
    except StartupError as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_STARTUP
    except PdkvError as exc:
        click.echo(f"error: {role} daemon failed: {exc}", err=True)
        return EXIT_STARTUP
    if exit_when_done:
        lifecycle.exit_now(code)
    return code


def _socket_of(cfg: DecodeConfig | PrefillConfig) -> Path:
    return cfg.client_path if isinstance(cfg, PrefillConfig) else cfg.link_path


def background_argv(g: Globals, cfg: DecodeConfig | PrefillConfig) -> list[str]:
    """The command line of a detached `pdkv <role> start` with `cfg`'s settings."""
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(g.runtime_dir)]
    argv += [
        "--log-format",
        "json" if g.log_format == "auto" else g.log_format,
        "--log-level",
        g.log_level,
    ]
    return [*argv, cfg.role, "start", *settings.argv(cfg)]


def _start_background(g: Globals, cfg: DecodeConfig | PrefillConfig) -> int:
    role = cfg.role
    pid = read_pid(cfg.pidfile)
    if pid is not None:
        click.echo(
            f"error: {role} daemon already running (pid {pid}); `pdkv stop {role}` first", err=True
        )
        return EXIT_STARTUP
    argv = background_argv(g, cfg)
    log_path = cfg.runtime_dir / f"{role}.log"
    with open(log_path, "ab") as log_file:
        start_offset = log_file.tell()  # the log is appended to: show only this start's lines
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file, start_new_session=True
        )
    sock = _socket_of(cfg)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            click.echo(
                f"error: {role} daemon exited with {proc.returncode}; log {log_path}:", err=True
            )
            click.echo(_tail(log_path, start_offset), err=True)
            return EXIT_STARTUP
        try:
            asyncio.run(client.status(str(sock), timeout=1.0))
        except (OSError, TimeoutError, PdkvError):
            time.sleep(0.1)
            continue
        click.echo(f"{role} daemon started (pid {proc.pid}), socket {sock}, log {log_path}")
        return EXIT_OK
    click.echo(f"error: {role} daemon did not become ready in 180 s; log {log_path}", err=True)
    return EXIT_STARTUP


def _tail(path: Path, offset: int, lines: int = 20) -> str:
    """The last `lines` lines written to `path` after byte `offset`."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def stop(g: Globals, *, which: str = "all", timeout: float = 30.0, port: int | None = None) -> int:
    """SIGTERM each daemon named by its pidfile and wait for it to exit: `which` is one role or
    all of them; the API role is every API in the runtime dir (one per port), or the one on
    `port`."""
    from api_server.config import api_file, api_pidfiles

    code = EXIT_OK
    for role in ("api", "prefill", "decode") if which == "all" else (which,):
        if role != "api":
            code = max(code, _stop_one(g, role, g.runtime_dir / f"{role}.pid", timeout))
            continue
        pidfiles = api_pidfiles(g.runtime_dir)
        if port is not None:
            pidfiles = {port: api_file(g.runtime_dir, port, "pid")}
        live = {p: f for p, f in pidfiles.items() if read_pid(f) is not None}
        for stale in set(pidfiles.values()) - set(live.values()):
            remove_file(stale)
        if not live and which != "all":  # the API is optional: `pdkv stop` names it if it ran
            click.echo("api: not running" + (f" on port {port}" if port is not None else ""))
        for p, pidfile in live.items():
            code = max(
                code,
                _stop_one(
                    g, f"api (port {p})", pidfile, timeout, api_file(g.runtime_dir, p, "log")
                ),
            )
    return code


def _stop_one(g: Globals, name: str, pidfile: Path, timeout: float, log: Path | None = None) -> int:
    """SIGTERM the process `pidfile` names and wait up to `timeout` for it to exit."""
    pid = read_pid(pidfile)
    if pid is None:
        remove_file(pidfile)  # stale or absent
        click.echo(f"{name}: not running")
        return EXIT_OK
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        click.echo(f"error: {name} (pid {pid}) still running after {timeout}s", err=True)
        return EXIT_FAIL
    if pidfile.exists():  # a clean shutdown removes it last: this one failed midway
        remove_file(pidfile)
        log = log or g.runtime_dir / f"{name}.log"
        click.echo(
            f"error: {name} (pid {pid}) exited without a clean shutdown; see {log}", err=True
        )
        return EXIT_FAIL
    click.echo(f"{name}: stopped (pid {pid})")
    return EXIT_OK


def _alive(pid: int) -> bool:
    """True while `pid` runs (rundir.pid_alive: a zombie counts as gone, and is reaped here if
    it is our child)."""
    if pid_alive(pid):
        return True
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return False


def start_api(g: Globals, **opts: Any) -> int:
    """Run the HTTP API (api_server) in the foreground, or detached with background=True."""
    from api_server import launch

    return launch.start(g.runtime_dir, log_format=g.log_format, log_level=g.log_level, **opts)


def demo(g: Globals, **opts: Any) -> int:
    from pdkv.demo import run_demo

    return run_demo(log_level=g.log_level, **opts)
