"""What `--model DIR` must be before anything reads it, in the words every process that takes
the option uses (both daemons' loader and `pdkv api start`). Without torch: the API imports it.
"""

from __future__ import annotations

from pathlib import Path

_HINT = "pass a Hugging Face checkpoint directory"


def model_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be a checkpoint directory, or None: it is not a directory (missing, or
    a file), or it is one without config.json."""
    if not path.is_dir():
        return f"--model {path} is not a directory ({_HINT})"
    if not (path / "config.json").is_file():
        return f"--model {path} has no config.json ({_HINT})"
    return None
