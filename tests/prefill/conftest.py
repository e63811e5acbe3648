"""The tiny model for the prefill's tests against the reference, and a prefill runtime for the
RequestPipeline tests (their helpers: tests.support.prefill, tests.support.prefill_pipeline)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.daemon.runtime import ModelRuntime
from common.model.loader import load_model
from prefill_server.config import PrefillConfig
from prefill_server.startup import load_runtime


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    return load_model(None)


@pytest.fixture(scope="module")
def cfg_rt(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[PrefillConfig, ModelRuntime]]:
    """The tiny model's prefill runtime on CPU with a 16-block pool, for RequestPipeline tests."""
    yield from _runtime(tmp_path_factory, 16)


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelRuntime]:
    """The tiny model's prefill runtime on CPU with a 64-block pool, for the forward's tests."""
    for _, runtime in _runtime(tmp_path_factory, 64):
        yield runtime


def _runtime(
    tmp_path_factory: pytest.TempPathFactory, num_blocks: int
) -> Iterator[tuple[PrefillConfig, ModelRuntime]]:
    cfg = PrefillConfig(
        runtime_dir=Path(tmp_path_factory.mktemp("rt")), device="cpu", num_blocks=num_blocks
    )
    runtime = load_runtime(cfg)
    yield cfg, runtime
    runtime.close()
