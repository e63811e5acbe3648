"""`pdkv api start`: build the ApiConfig from CLI options, then serve in the foreground or detach
a child and return once it answers HTTP. The API key reaches a detached child through its
environment (PDKV_API_KEY), never its command line, which any local user can read."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click

from api_server.config import ApiConfig, base_url, running_apis
from api_server.daemons import check_at_start
from common import settings
from common.daemon import logs
from common.daemon.rundir import StartupError, ensure_runtime_dir, read_pid

EXIT_OK, EXIT_STARTUP = 0, 3
READY_TIMEOUT_S = 60.0


def start(
    runtime_dir: Path, *, log_format: str, log_level: str, background: bool = False, **opts: Any
) -> int:
    """Serve the API (foreground) or start it detached; exit code 3 when it cannot start.
    `opts` are ApiConfig's fields (the parameters of `pdkv api start`)."""
    try:
        cfg = ApiConfig(runtime_dir=runtime_dir, **opts)
        ensure_runtime_dir(runtime_dir)
        check_at_start(cfg)
    except (StartupError, OSError) as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_STARTUP
    if background:
        return _detach(cfg, log_level=log_level)
    logs.configure(log_format, log_level)  # type: ignore[arg-type]
    from api_server.server import run

    try:
        worker_argv = _command(cfg, log_format=log_format, log_level=log_level)
        return run(cfg, drain_timeout_s=cfg.drain_timeout_s, worker_argv=worker_argv)
    except StartupError as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_STARTUP


def _detach(cfg: ApiConfig, *, log_level: str) -> int:
    pid = read_pid(cfg.file("pid")) if cfg.port else None  # port 0: a new port each time
    if pid is not None:
        click.echo(
            f"error: api already running on port {cfg.port} (pid {pid}); "
            f"`pdkv stop api --port {cfg.port}` first",
            err=True,
        )
        return EXIT_STARTUP
    argv = [*_command(cfg, log_format="json", log_level=log_level), *settings.argv(cfg)]
    env = dict(os.environ)
    env.pop("PDKV_API_KEY", None)
    if cfg.api_key:
        env["PDKV_API_KEY"] = cfg.api_key
    log_path = cfg.file("log")
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            env=env,
            start_new_session=True,
        )
    url = base_url(cfg.host, cfg.port) if cfg.port else None  # --port 0: its URL file says
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            click.echo(f"error: api exited with {proc.returncode}; see {log_path}", err=True)
            return EXIT_STARTUP
        if url is None:
            url = next((a.url for a in running_apis(cfg.runtime_dir) if a.pid == proc.pid), None)
        if url is not None and _answers(url, cfg.api_key):
            click.echo(f"api started (pid {proc.pid}), {url}/v1, log {log_path}")
            return EXIT_OK
        time.sleep(0.1)
    click.echo(f"error: api did not answer in {READY_TIMEOUT_S:g} s; log {log_path}", err=True)
    return EXIT_STARTUP


def _command(cfg: ApiConfig, *, log_format: str, log_level: str) -> list[str]:
    """`pdkv api start` with these logging options, before its settings (settings.argv: all but
    the key, which goes in the environment)."""
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(cfg.runtime_dir)]
    return [*argv, "--log-format", log_format, "--log-level", log_level, "api", "start"]


def _answers(url: str, api_key: str | None) -> bool:
    """True when GET /v1/models answers 200."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url + "/v1/models", headers=headers), timeout=1
        ) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False
