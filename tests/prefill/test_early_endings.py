"""Every way an early-handed-off request can end on the prefill side, and what it leaves: its
blocks freed once and never under its forward, its event slot free again (quarantined only while
the decode may wait on it, and only until the decode answers), an ABORT only to a decode that
may hold the request.

Real parts: the tiny model's runtime on CPU, the prefill's RequestPipeline and PrefillBatcher
(its forward runs when the test starts the batcher), the producer with the slot bookkeeping of
an event ring (CpuEventRing: CUDA's, with no-op records). The one fake is the link: it records
what the pipeline sends, and the test delivers the decode's answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.config import PrefillConfig
from common.ipc.events import CpuEventRing
from common.model.sampling import SamplingParams
from common.modelrt import ModelRuntime
from common.protocol import (
    Abort,
    Error,
    ErrorCode,
    Generate,
    Handoff,
    KvReady,
    Message,
    Release,
)
from common.transfer import KVProducer
from prefill_server.pipeline import RequestPipeline
from prefill_server.request import RequestFailed

SLOTS = 4


class FakeLink:
    """Stands in for prefill_server.link.DecodeLink: up, and what is sent lands in `sent`."""

    tcp = None

    def __init__(self) -> None:
        self.link_id = "link-1"
        self.ready = asyncio.Event()
        self.ready.set()
        self.sent: list[Message] = []

    async def wait_up(self, timeout: float) -> None:
        if not self.ready.is_set():
            raise ConnectionError("no link to the decode daemon")

    async def send(self, msg: Message, *, spin: bool = False) -> None:
        if not self.ready.is_set():
            raise ConnectionError("no link to the decode daemon")
        self.sent.append(msg)

    def post(self, msg: Message) -> None:
        if self.ready.is_set():
            self.sent.append(msg)

    def of(self, kind: type, rid: str) -> list:
        return [m for m in self.sent if isinstance(m, kind) and m.request_id == rid]


@pytest.fixture(scope="module")
def cfg_rt(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[PrefillConfig, ModelRuntime]]:
    cfg = PrefillConfig(
        runtime_dir=Path(tmp_path_factory.mktemp("rt")), device="cpu", num_blocks=16
    )
    runtime = ModelRuntime.load(cfg, "prefill")
    yield cfg, runtime
    runtime.close()


class Setup:
    def __init__(self, cfg: PrefillConfig, rt: ModelRuntime) -> None:
        self.rt = rt
        self.producer = KVProducer(rt.pool, rt.allocator, rt.backend, event_slots=SLOTS)
        self.producer.events = CpuEventRing(SLOTS)  # slots as on CUDA: quarantine applies
        self.link = FakeLink()
        self.pipeline = RequestPipeline(cfg, rt, self.producer, self.link)  # type: ignore[arg-type]
        self.batcher_task: asyncio.Task[None] | None = None

    def start(self, rid: str) -> asyncio.Task[list]:
        """One request, as the server runs it: its frames collected, or its RequestFailed."""
        msg = Generate(
            sampling=SamplingParams(max_tokens=4, ignore_eos=True), prompt_tokens=[3] * 20
        )

        async def consume() -> list:
            return [m async for m in self.pipeline.run(rid, msg)]

        return asyncio.create_task(consume())

    def run_forwards(self) -> None:
        self.batcher_task = asyncio.create_task(self.pipeline.batcher.run())

    async def until(self, cond) -> None:  # type: ignore[no-untyped-def]
        async with asyncio.timeout(10):
            while not cond():
                await asyncio.sleep(0.001)

    def slots_free(self) -> int:
        assert self.producer.events is not None
        return self.producer.events.free_count

    def clean(self) -> bool:
        a = self.rt.allocator
        return a.num_free == a.total and self.slots_free() == SLOTS

    async def close(self) -> None:
        if self.batcher_task is not None:
            self.batcher_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.batcher_task


async def _cancelled(task: asyncio.Task[list]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)


async def test_a_refused_early_handoff_then_the_client_leaving_gets_no_abort_and_no_quarantine(
    cfg_rt,  # type: ignore[no-untyped-def]
):
    """The decode answered NO_CAPACITY (it holds nothing) and the request ends before the relay
    read that: an ABORT would be answered CACHE_NOT_EXIST, never RELEASE, and a slot
    quarantined for it would stay out of use until the link ends."""
    s = Setup(*cfg_rt)
    task = s.start("r1")
    await s.until(lambda: s.link.of(Handoff, "r1"))
    assert s.link.of(Handoff, "r1")[0].first_token is None  # the forward has not run
    s.pipeline.deliver(Error(code=ErrorCode.NO_CAPACITY, message="full", request_id="r1"))
    await _cancelled(task)
    assert s.link.of(Abort, "r1") == []
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


async def test_the_client_leaving_before_the_first_token_aborts_and_frees_the_slot_at_once(
    cfg_rt,  # type: ignore[no-untyped-def]
):
    s = Setup(*cfg_rt)
    task = s.start("r1")
    await s.until(lambda: s.link.of(Handoff, "r1"))
    await _cancelled(task)
    assert len(s.link.of(Abort, "r1")) == 1  # the decode reserved blocks for it
    assert s.link.of(KvReady, "r1") == []  # no KV was offered: the slot was never waited on
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


@pytest.mark.parametrize("answer", ["release", "cache_not_exist"])
async def test_after_its_first_token_an_aborted_request_holds_its_slot_until_the_decode_answers(
    cfg_rt,  # type: ignore[no-untyped-def]
    answer: str,
):
    s = Setup(*cfg_rt)
    task = s.start("r1")
    s.run_forwards()
    await s.until(lambda: s.link.of(KvReady, "r1"))  # the KV offered: the decode may wait now
    slot = s.link.of(Handoff, "r1")[0].event_slot
    await _cancelled(task)
    assert len(s.link.of(Abort, "r1")) == 1
    assert s.slots_free() == SLOTS - 1  # quarantined: the decode may still wait on it
    again = s.start("r1")  # the same id before the decode answered: refused, not mixed up
    with pytest.raises(RequestFailed, match="already in flight"):
        await asyncio.wait_for(again, 10)
    if answer == "release":
        s.pipeline.deliver(Release(request_id="r1", event_slot=slot))
    else:
        s.pipeline.deliver(Error(code=ErrorCode.CACHE_NOT_EXIST, message="gone", request_id="r1"))
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()


async def test_a_link_lost_during_the_forward_frees_the_blocks_only_after_it(
    cfg_rt,  # type: ignore[no-untyped-def]
):
    """The blocks of an early HANDOFF are not leased before their KV is written: losing the link
    must not free them under the forward that writes them (a new request could get them)."""
    s = Setup(*cfg_rt)
    task = s.start("r1")
    await s.until(lambda: s.link.of(Handoff, "r1"))
    s.link.ready.clear()
    s.pipeline.link_lost("link-1", "test")
    assert "r1" in s.rt.allocator and s.rt.allocator.num_leased == 0  # still its own
    s.pipeline.deliver(Release(request_id="r1", event_slot=0))  # a stray one: late, harmless
    assert "r1" in s.rt.allocator
    s.run_forwards()
    with pytest.raises(RequestFailed) as info:
        await asyncio.wait_for(task, 10)
    assert info.value.code == ErrorCode.LINK_LOST
    assert s.link.of(KvReady, "r1") == [] and s.link.of(Abort, "r1") == []
    assert s.clean(), (s.rt.allocator, s.slots_free())
    await s.close()
