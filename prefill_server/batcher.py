"""Continuous batching of prefills: requests that hold their blocks (and event slot) queue here, and
one task runs everything queued, up to a token budget, as one varlen forward on the torch thread.

There is no waiting window: a forward starts as soon as something is queued and the previous
forward has returned, so at low load a prompt runs alone at once, and under a burst the prompts
that arrive while one forward runs share the next. The queue is served in arrival order; a batch
takes prompts while their tokens fit `max_tokens`, and a prompt longer than that runs alone.

Contract with the pipeline: `submit` queues a prompt and returns a future of its first token (or
of RequestFailed for that request only: NUMERIC_ERROR when its logits are not finite, INTERNAL
when the batch's forward failed, SHUTTING_DOWN when the batcher stopped with the request still
queued). A request whose future is cancelled while queued is dropped from
the queue and never runs, so its blocks, freed by the pipeline, can go to a new request at once;
one cancelled while its batch runs is written anyway, and its blocks can only go to a later
batch, which the single torch thread (and stream) orders after this one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import structlog

from common.model.sampling import SamplingError, SamplingParams
from common.modelrt import ModelRuntime
from common.protocol import ErrorCode
from common.transfer import Producer
from prefill_server.forward import FirstToken, run_prefill_batch
from prefill_server.request import RequestFailed

log = structlog.get_logger(__name__)
_LOGGED_IDS = 16  # request ids named in one prefill_batch log line


@dataclass(eq=False)
class _Job:
    request_id: str
    prompt: list[int]
    blocks: list[int]
    sampling: SamplingParams
    event_slot: int
    future: asyncio.Future[tuple[FirstToken, int]]  # (first token, requests in its forward)


class PrefillBatcher:
    """Created by the pipeline; the server runs `run()` as a task for the daemon's life."""

    def __init__(self, rt: ModelRuntime, producer: Producer, max_tokens: int) -> None:
        self.rt = rt
        self.producer = producer
        self.max_tokens = max_tokens
        self.forwards = 0  # batches run since start
        self.prompts = 0  # prompts prefilled since start
        self._queue: deque[_Job] = deque()
        self._wake = asyncio.Event()

    def submit(
        self,
        request_id: str,
        prompt: list[int],
        blocks: list[int],
        sampling: SamplingParams,
        event_slot: int,
    ) -> asyncio.Future[tuple[FirstToken, int]]:
        """Queue the prompt for the next batch: a future of (its first token, the number of
        requests that shared its forward) once that batch has run, or of RequestFailed for this
        request. Cancel it if the request goes away: a prompt not yet run is then skipped."""
        future: asyncio.Future[tuple[FirstToken, int]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Job(request_id, prompt, blocks, sampling, event_slot, future))
        self._wake.set()
        return future

    async def run(self) -> None:
        """Forever: take what is queued (within the budget), run it, answer each request."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while batch := self._take():
                    await self._run_batch(batch)
        finally:
            for job in self._queue:
                _answer(
                    job, RequestFailed(ErrorCode.SHUTTING_DOWN, "prefill daemon is shutting down")
                )
            self._queue.clear()

    def _take(self) -> list[_Job]:
        """The queue's head in order while the prompts fit `max_tokens` (the first always goes);
        jobs whose request was cancelled are dropped."""
        batch: list[_Job] = []
        used = 0
        while self._queue:
            job = self._queue[0]
            if job.future.done():
                self._queue.popleft()
                continue
            n = len(job.prompt)
            if batch and used + n > self.max_tokens:
                break
            batch.append(self._queue.popleft())
            used += n
        return batch

    async def _run_batch(self, batch: list[_Job]) -> None:
        tokens = sum(len(j.prompt) for j in batch)
        ids = [j.request_id for j in batch]
        start = time.perf_counter()
        try:
            firsts = await self.rt.run(
                run_prefill_batch,
                self.rt,
                [j.prompt for j in batch],
                [j.blocks for j in batch],
                [j.sampling for j in batch],
                self.producer,
                [j.event_slot for j in batch],
                token_budget=max(self.max_tokens, tokens),
            )
        except Exception as exc:  # the forward failed: its requests fail, the daemon goes on
            log.exception(
                "prefill_batch_failed", requests=len(batch), request_ids=ids[:_LOGGED_IDS]
            )
            why = f"prefill forward failed: {type(exc).__name__}: {exc}"
            for job in batch:
                _answer(job, RequestFailed(ErrorCode.INTERNAL, why))
            return
        self.forwards += 1
        self.prompts += len(batch)
        forward_ms = round((time.perf_counter() - start) * 1000, 3)
        for job, first in zip(batch, firsts, strict=True):
            if isinstance(first, SamplingError):
                _answer(job, RequestFailed(ErrorCode.NUMERIC_ERROR, str(first)))
            else:
                _answer(job, (first, len(batch)))
        await asyncio.sleep(0)  # the first tokens go out before this line is written (~30 µs)
        log.info(
            "prefill_batch",
            requests=len(batch),
            tokens=tokens,
            forward_ms=forward_ms,
            request_ids=ids[:_LOGGED_IDS],
        )


def _answer(job: _Job, result: tuple[FirstToken, int] | BaseException) -> None:
    if job.future.done():  # cancelled while its batch ran
        return
    if isinstance(result, BaseException):
        job.future.set_exception(result)
    else:
        job.future.set_result(result)
