"""The prefill's RequestPipeline on real parts but its link: the tiny model's runtime on CPU, the
PrefillBatcher (its forward runs when the test starts the batcher), the producer with the slot
bookkeeping of an event ring (CpuEventRing: CUDA's, with no-op records). The one fake is the link
(FakeLink): it records what the pipeline sends, and the test delivers the decode's answers.
"""

from __future__ import annotations

import asyncio
import contextlib

from common.daemon.runtime import ModelRuntime
from common.ipc.events import CpuEventRing
from common.model.sampling import SamplingParams
from common.protocol import Generate, Message
from common.transfer import KVProducer
from prefill_server.client_writer import ClientWriter
from prefill_server.config import PrefillConfig
from prefill_server.decode_links import DecodeLinks
from prefill_server.link import DecodeLoad
from prefill_server.pipeline import RequestPipeline

__all__ = ["SLOTS", "FakeLink", "Setup", "cancelled"]

SLOTS = 4


class FakeLink:
    """Stands in for prefill_server.link.DecodeLink: up, and what is sent lands in `sent`."""

    tcp = None

    def __init__(self, link_id: str = "link-1") -> None:
        self.link_id = link_id
        self.address = f"fake-{link_id}"
        self.last_error = ""
        self.load = DecodeLoad()
        self.ready = asyncio.Event()
        self.ready.set()
        self.sent: list[Message] = []

    async def wait_up(self, timeout: float, *, patient: bool = True) -> None:
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


class Setup:
    def __init__(self, cfg: PrefillConfig, rt: ModelRuntime, decodes: int = 1) -> None:
        self.rt = rt
        self.producer = KVProducer(rt.pool, rt.allocator, rt.backend, event_slots=SLOTS)
        self.producer.events = CpuEventRing(SLOTS)  # slots as on CUDA: quarantine applies
        self.links = [FakeLink(f"link-{i + 1}") for i in range(decodes)]
        self.link = self.links[0]
        links = DecodeLinks(self.links)  # type: ignore[arg-type]
        self.pipeline = RequestPipeline(cfg, rt, self.producer, links)
        self.batcher_task: asyncio.Task[None] | None = None

    def sent(self, kind: type, rid: str) -> list[tuple[str, Message]]:
        """(link id, frame) of every `kind` frame for `rid`, on any link, in link order."""
        return [(link.link_id, m) for link in self.links for m in link.of(kind, rid)]

    def start(
        self,
        rid: str,
        max_tokens: int = 4,
        prompt: list[int] | None = None,
        writer: ClientWriter | None = None,
    ) -> asyncio.Task[list]:
        """One request, as the server runs it: the frames its task relays collected (and sent
        to `writer`, which the pipeline may then relay TOKENS to itself), or its RequestFailed."""
        msg = Generate(
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            prompt_tokens=prompt or [3] * 20,
        )

        async def consume() -> list:
            frames = []
            async for m in self.pipeline.run(rid, msg, writer):
                frames.append(m)
                if writer is not None:
                    await writer.send(m)
            return frames

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


async def cancelled(task: asyncio.Task[list]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
