"""The HTTP tests' stack: real daemons and a real API server process (tests.support.api)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.api import Stack, running_stack
from tests.support.tool_checkpoint import MODEL, tool_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack shared by a module's tests; prompts of at most 256 tokens."""
    with running_stack(tmp_path_factory, "--max-prompt-tokens", "256") as s:
        yield s


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack of the Qwen-like tool checkpoint (tests.support.tool_checkpoint), per module."""
    with tool_stack(tmp_path_factory, MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def ckpt(qwen: Stack) -> Path:
    """That checkpoint's directory, as the daemons report it."""
    return Path(qwen.statuses()["prefill"].model_card.path)
