"""Where Triton keeps the kernels it compiles, so that a restarted daemon finds them.

Triton reads `TRITON_CACHE_DIR` (default `~/.triton/cache`, which a systemd unit with
ProtectHome, a container or a pod often cannot keep). `configure` sets it for this process before
anything imports triton (the daemons call it first thing in `ModelRuntime.load`, and log the
`kernel_cache` line once the model is loaded): the
`--kernel-cache-dir` setting when given, else the TRITON_CACHE_DIR the user set, else
`$XDG_CACHE_HOME/pdkv/triton` (`~/.cache/pdkv/triton`). The deploy files keep it on a
persistent path (docs/operations.md, "Cold start").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)
ENV = "TRITON_CACHE_DIR"


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/pdkv/triton`, or `~/.cache/pdkv/triton` when the variable is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdkv" / "triton"


def resolve(configured: Path | None) -> tuple[Path, str]:
    """The directory and where it came from: "setting", "env" (TRITON_CACHE_DIR) or "default"."""
    if configured is not None:
        return Path(configured).expanduser(), "setting"
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser(), "env"
    return default_dir(), "default"


def configure(configured: Path | None) -> dict[str, object]:
    """Point TRITON_CACHE_DIR at the kernel cache (made 0700 if missing) for this process and
    its children. Returns what the daemon logs once started (`kernel_cache`): the directory,
    where it came from, the kernels already in it, and whether triton was imported before
    (then it may have read another directory)."""
    path, source = resolve(configured)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("kernel_cache_unusable", dir=str(path), error=str(exc))
    os.environ[ENV] = str(path)
    return {
        "dir": str(path),
        "source": source,
        "entries": _entries(path),
        "triton_imported_before": "triton" in sys.modules,
    }


def _entries(path: Path) -> int:
    """Kernels compiled into the cache so far (Triton: one directory per kernel variant)."""
    try:
        return sum(1 for p in path.iterdir() if p.is_dir())
    except OSError:
        return 0


__all__ = ["ENV", "configure", "default_dir", "resolve"]
