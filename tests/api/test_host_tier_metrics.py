"""The host KV tier on the API's /metrics: its size, and the blocks the prefill wrote into it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.api import MODEL, Stack, metrics, running_stack
from tests.support.wait import poll

PROMPT = "A system prompt every request of this service starts with, then a question."  # 75 bytes


@pytest.fixture(scope="module")
def tier_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    path = Path(f"/dev/shm/pdkv-test-api-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with running_stack(
            tmp_path_factory, "--host-cache-gb", "0.01", "--host-cache-path", str(path)
        ) as s:
            yield s
    finally:
        path.unlink(missing_ok=True)


def test_metrics_show_the_tier(tier_stack: Stack) -> None:
    done = tier_stack.api.sync_client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    n = done.usage.prompt_tokens
    key = "pdkv_host_tier_{}{{role=prefill}}"
    # written through on the prefill's torch thread after the forward: polled
    poll(lambda: metrics(tier_stack)[key.format("stored_total")] == n // 16, what="stored")
    m = metrics(tier_stack)
    slots, size = m[key.format("slots")], m[key.format("capacity_bytes")]
    assert 0 < size <= 0.01 * 2**30 and size % slots == 0  # whole slots
    assert m[key.format("bytes_written_total")] == n // 16 * size / slots
    assert m[key.format("used")] >= n // 16
    assert m[key.format("checksum_failures_total")] == 0
    assert "pdkv_host_tier_stored_total{role=decode}" not in m  # the decode runs without it
