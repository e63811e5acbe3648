"""Fixtures every directory of tests/ may use: a short runtime dir, and a Pair on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemons import Pair, short_dir


@pytest.fixture
def runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return short_dir(tmp_path_factory)


@pytest.fixture
def pair_factory(runtime_dir: Path) -> Iterator[Pair]:
    """A Pair with nothing started yet; whatever runs is killed at the end."""
    pair = Pair(runtime_dir)
    yield pair
    pair.kill_all()
