"""Fixtures every directory of tests/ may use: a short runtime dir, and a Pair on it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemons import Pair


@pytest.fixture
def runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # AF_UNIX paths are limited to 108 bytes: keep the runtime dir short.
    path = Path(tmp_path_factory.mktemp("rt", numbered=True))
    os.chmod(path, 0o700)
    return path


@pytest.fixture
def pair_factory(runtime_dir: Path) -> Iterator[Pair]:
    """A Pair with nothing started yet; whatever runs is killed at the end."""
    pair = Pair(runtime_dir)
    yield pair
    pair.kill_all()
