"""Real daemon processes on real Unix sockets (tests.support.daemons), started through the CLI."""

from __future__ import annotations

import pytest

from tests.support.daemons import Pair


@pytest.fixture
def pair(pair_factory: Pair) -> Pair:
    pair_factory.start("decode")
    pair_factory.start("prefill")
    return pair_factory
