"""GPU tests: skipped cleanly where CUDA is unavailable; children are spawned (never forked)."""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.cuda import cuda_available

# Spawned children import their entry points from gpu_procs by plain name.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="CUDA unavailable (no driver or no GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def spawn() -> Iterator[mp.context.SpawnContext]:
    """The spawn context; children still alive at teardown are killed."""
    ctx = mp.get_context("spawn")
    yield ctx
    for child in mp.active_children():
        child.kill()
        child.join(timeout=10)
