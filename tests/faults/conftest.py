"""Fault-injection fixtures: a pair of real daemon processes (tests.support.daemons' FaultPair),
the tiny model and its reference tokens.

Everything waits by polling with a generous bound (no timed assertions, tests.support.wait): a
condition that never comes true fails with the last value seen, a hung client fails through its
own timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from tests.support.daemons import BLOCK, FaultPair, new_pair


@pytest.fixture(scope="session")
def tiny_model():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tok = load_model(None)
    yield model, tok
    torch.set_num_threads(before)


@pytest.fixture
def expect(tiny_model) -> Callable[[list[int], SamplingParams], list[int]]:
    """The single-process reference's tokens for (prompt, params)."""
    model, _ = tiny_model

    def run(prompt: list[int], params: SamplingParams) -> list[int]:
        return reference.generate(model, prompt, params, block_size=BLOCK)

    return run


@pytest.fixture
def fault_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultPair]:
    pair = new_pair(tmp_path_factory, "ft")
    yield pair
    pair.kill_all()
