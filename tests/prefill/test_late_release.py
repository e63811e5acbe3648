"""A RELEASE for a request id the prefill holds but has not handed off (the id reused after a
lease expired, the decode's RELEASE for the old one late): a late RELEASE, never a release."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from common.daemon.runtime import ModelRuntime
from common.model.sampling import SamplingParams
from common.protocol import Release
from common.transfer import KVProducer
from prefill_server.config import PrefillConfig
from prefill_server.phase import Phase
from prefill_server.pipeline import RequestPipeline
from prefill_server.request import PrefillRequest
from prefill_server.startup import load_runtime


@pytest.fixture(scope="module")
def cfg_rt(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[PrefillConfig, ModelRuntime]]:
    cfg = PrefillConfig(runtime_dir=Path(tmp_path_factory.mktemp("rt")), device="cpu", num_blocks=8)
    runtime = load_runtime(cfg)
    yield cfg, runtime
    runtime.close()


async def test_a_release_before_the_handoff_frees_nothing_and_does_not_raise(cfg_rt):  # type: ignore[no-untyped-def]
    cfg, rt = cfg_rt
    producer = KVProducer(rt.pool, rt.allocator, rt.backend, event_slots=1)
    pipeline = RequestPipeline(cfg, rt, producer, links=None)  # type: ignore[arg-type]
    blocks = rt.allocator.allocate("x", 2)
    pipeline.requests["x"] = PrefillRequest("x", [1, 2, 3], SamplingParams(max_tokens=4))
    try:
        pipeline.deliver(Release(request_id="x"))  # raised AllocatorError in the read callback
        assert "x" in rt.allocator and pipeline.requests["x"].phase is Phase.ADMITTED
        assert rt.allocator.num_free == rt.allocator.total - len(blocks)
    finally:
        rt.allocator.free("x")
