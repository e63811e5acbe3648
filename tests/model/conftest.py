"""Fixtures of the model tests: the tiny model, and one intra-op thread for their duration.

Tiny tensors on a shared 2-core machine run orders of magnitude faster on one thread (OpenMP
workers spin against each other), so the model tests pin one and restore the setting afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from common.model import LlamaModel, tiny_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return tiny_model()
