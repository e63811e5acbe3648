"""The decode side without processes: a real tiny-model runtime, a real producer pool in shared
memory opened through a real KVConsumer, and a fake link that records what the decode posts
(the fixtures that build them: tests/decode/conftest.py).

The other fakes stand for what cannot exist without a GPU or a second host: the CUDA event a
stream-ordered pull records (DeferredConsumer, FakeEvent), and a transfer no stream can wait on
(LaterConsumer, NIXL's shape). The copies themselves run for real.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec
import torch

from common.daemon.runtime import ModelRuntime
from common.kv.pool import KVPool
from common.model.paged import blocks_for, slots_for
from common.model.sampling import SamplingParams, make_generator, sample
from common.protocol import Handoff, Message, StepTokens
from common.transfer import KVConsumer, KVProducer
from common.transfer.consumer import AFTER_DONE
from decode_server.requests import DecodeRequests

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
#: a prompt of a few tokens, over two of the decode tests' 4-token blocks
PROMPT = [5, 17, 99, 3, 42, 8, 250]


@dataclass(eq=False)
class FakeLink:
    """Stands in for decode_server.peer.Peer: what DecodeRequests posts lands in `sent`."""

    link_id: str
    consumer: KVConsumer
    sent: list[Message] = field(default_factory=list)  # STEP_TOKENS as its TOKENS and FINISHes
    frames: list[Message] = field(default_factory=list)  # what was posted, as posted
    handoffs: int = 0
    closed: bool = False
    channel: Any = field(default_factory=lambda: SimpleNamespace(last_rx=time.monotonic()))

    def post(self, msg: Message) -> None:
        self.frames.append(msg)
        self.sent.extend(msg.frames() if isinstance(msg, StepTokens) else [msg])

    def post_many(self, msgs: list[Message]) -> None:
        for msg in msgs:
            self.post(msg)

    def post_error(self, code, message: str, request_id: str | None = None) -> None:  # type: ignore[no-untyped-def]
        from common.protocol import make_error

        self.post(make_error(code, message, request_id))

    def of(self, kind: type) -> list:
        return [m for m in self.sent if isinstance(m, kind)]


@dataclass
class Side:
    """The prefill's half, in this process: its pool, allocator and producer."""

    producer: KVProducer
    rt: ModelRuntime

    @property
    def pool(self) -> KVPool:
        return self.producer.pool

    def prefill(self, rid: str, prompt: list[int], params: SamplingParams) -> Handoff:
        """A real prefill into this side's pool, and the HANDOFF that names it."""
        bs = self.pool.layout.block_size
        blocks = self.producer.allocator.allocate(rid, blocks_for(len(prompt), bs))
        dev = self.pool.device
        logits = self.rt.model.prefill(
            torch.tensor(prompt, device=dev),
            slots_for(blocks, 0, len(prompt), bs).to(dev),
            self.pool.tensor,
        )
        first = sample(logits, params, make_generator(params, 0))
        return Handoff(
            request_id=rid,
            block_ids=blocks,
            num_tokens=len(prompt),
            prompt_tokens=prompt,
            first_token=first,
            sampling=params,
        )


def open_consumer(side: Side, local: KVPool) -> KVConsumer:
    """REGISTER as the link carries it: the fds arrive as duplicates (SCM_RIGHTS)."""
    reg, fds = side.producer.register()
    return KVConsumer.open(reg, lambda n: [os.dup(fd) for fd in fds[:n]], local)


class FakeEvent:
    """Stands in for the torch.cuda.Event recorded after a pull's copy: the waiter thread's
    synchronize() blocks until the test calls complete()."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.waited_by: list[str] = []  # threads whose stream was made to wait on it

    def complete(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def synchronize(self) -> None:
        assert self._done.wait(30), "the test never completed this pull"
        if self.error is not None:
            raise self.error

    def wait(self, stream: object = None) -> None:  # the engine's stream-side wait
        self.waited_by.append(threading.current_thread().name)


class DeferredConsumer(KVConsumer):
    """KVConsumer taking its stream-ordered branch: the copy runs on the CPU, the returned
    event completes when the test says so."""

    def _enqueue(self, peer: KVPool, plan):  # type: ignore[no-untyped-def]
        self.local.copy_blocks_from(peer, plan.src_ids, plan.dst_ids)
        event = FakeEvent()
        self.events.append(event)
        return event


class LaterConsumer(KVConsumer):
    """A consumer whose blocks arrive by a transfer no stream can wait on (NIXL's shape): `pull`
    returns AFTER_DONE and the copy lands when the test calls `land()`."""

    def pull(self, src_ids, dst_ids, slot, done):  # type: ignore[no-untyped-def]
        self.pending.append((src_ids, dst_ids, done))
        return AFTER_DONE

    def land(self) -> None:
        src_ids, dst_ids, done = self.pending.pop(0)
        self.local.copy_blocks_from(self._peer(), src_ids, dst_ids)
        done(None)


async def decode_until(table: DecodeRequests, done, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    """Run the decode loop until done() holds (within `timeout` s); a failing step fails the
    test."""
    loop = asyncio.create_task(table.run())
    try:
        async with asyncio.timeout(timeout):
            while not done():
                assert not loop.done(), loop.exception()
                await asyncio.sleep(0.01)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


def early(h: Handoff) -> Handoff:
    """The HANDOFF as the prefill sends it early: the same, without its first token."""
    return msgspec.structs.replace(h, first_token=None)
