"""`pdkv model get`: real checkpoints made from models shipped in packages (pdkv/models.py).

`pdkv model get` is the same command as `python -m pdkv.models`: it prints the checkpoint's
directory on stdout (for `MODEL=$(pdkv model get)`), its progress on stderr, and exits 1 with one
line naming the pip command when a package is missing.
"""

from __future__ import annotations

import click

from pdkv import models


@click.group()
def model() -> None:
    """Checkpoints of the models shipped in packages (SmolLM2-135M-Instruct), made once, cached."""


model.add_command(models.main, name="get")
