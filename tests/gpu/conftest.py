"""GPU tests: skipped cleanly where CUDA is unavailable; children are spawned (never forked), their
entry points in tests.support.gpu_procs."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator

import pytest

from common.cuda import cuda_available


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
