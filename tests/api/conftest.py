"""The HTTP tests' stack: real daemons and a real API server process (tests.support.api)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.api import Stack, running_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack shared by a module's tests; prompts of at most 256 tokens."""
    with running_stack(tmp_path_factory, "--max-prompt-tokens", "256") as s:
        yield s
