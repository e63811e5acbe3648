"""Continuous batching of prefills: requests that hold their blocks (and event slot) queue here, and
one task runs everything queued, up to a token budget, as one varlen forward on the torch thread.

There is no waiting window: a forward starts as soon as something is queued and the previous
forward has returned, so at low load a prompt runs alone at once, and under a burst the prompts
that arrive while one forward runs share the next. The queue is served in arrival order; a batch
takes prompts while their tokens fit `max_tokens` (the first always goes).

What a prompt computes starts after its cached prefix (`start`: the pipeline found those blocks
in the prefix cache). Chunked prefill: a prompt with more than `chunk` tokens left to compute runs
one chunk per forward, each attending to the ones before it through the pool, and goes back to
the end of the queue between chunks, so it neither needs one giant forward nor holds the prompts
behind it back for its whole length. A prompt that asks for prompt logprobs (its logits at every
position) is the exception: it has no cached prefix and is never chunked, one forward computes it
whole.

Contract with the pipeline: `submit` queues a prompt and returns a future of its first token (or
of RequestFailed for that request only: NUMERIC_ERROR when its logits are not finite, INTERNAL
when the batch's forward failed, SHUTTING_DOWN when the batcher stopped with the request still
queued). A request whose future is cancelled while queued is dropped from
the queue and never runs, so its blocks, freed by the pipeline, can go to a new request at once;
one cancelled while its batch runs is written anyway, and its blocks can only go to a later
batch, which the single torch thread (and stream) orders after this one. The future resolves
only once the prompt's last chunk is written: then (and not before) its blocks may be named in
the prefix cache.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from common.daemon.runtime import ModelRuntime
from common.model.sampling import SamplingError, SamplingParams
from common.protocol import ErrorCode
from common.timings import Marks
from common.transfer import Producer
from prefill_server.forward import FirstToken, Piece, run_prefill_batch
from prefill_server.request import RequestFailed

log = structlog.get_logger(__name__)
_LOGGED_IDS = 16  # request ids named in one prefill_batch log line
#: how long the torch thread lets go of the GIL for the loop to send a batch's KV_LAUNCHED frames
#: before it goes on to the draw (whose host sync may not let go of it until the GPU is done)
LAUNCH_SEND_WAIT_S = 0.002


@dataclass(eq=False)
class _Job:
    request_id: str
    prompt: list[int]
    blocks: list[int]
    sampling: SamplingParams
    event_slot: int
    future: asyncio.Future[tuple[FirstToken, int]]  # (first token, requests in its forward)
    start: int = 0  # positions whose K/V is in the pool: its cached prefix, then its chunks
    marks: Marks | None = None  # its request's: forward_started (first chunk), forward_done

    def piece(self, most: int) -> Piece:
        """The next at most `most` positions to compute (its last piece samples). A prompt that
        asks for prompt logprobs is never chunked: its one piece is the whole prompt, so its
        logits at every position come from one forward."""
        if self.sampling.prompt_logprobs is not None:
            most = len(self.prompt)
        end = min(len(self.prompt), self.start + most)
        last = end == len(self.prompt)
        sampling = self.sampling if last else None
        slot = self.event_slot if last else -1
        return Piece(self.prompt, self.start, end, self.blocks, sampling, slot)


@dataclass(eq=False)
class _Running:
    """A forward sent to the torch thread: its batch, and what its log line reports."""

    taken: list[tuple[_Job, Piece]]
    ids: list[str]
    tokens: int
    started_ns: int  # monotonic ns when it was sent
    gap: float | None  # ms since the forward it queued behind returned
    future: asyncio.Future[list]


class PrefillBatcher:
    """Created by the pipeline; the server runs `run()` as a task for the daemon's life."""

    def __init__(
        self,
        rt: ModelRuntime,
        producer: Producer,
        max_tokens: int,
        chunk: int | None = None,
        launched: Callable[[list[str], int], None] | None = None,
        quiet: Callable[[list[str]], bool] | None = None,
        pipelined: bool = True,
    ) -> None:
        self.rt = rt
        self.producer = producer
        # on the loop: the request ids whose forward, first token (the producer's mailbox) and
        # slot record a batch has queued on the GPU, before that batch's host sync, and when
        # (monotonic ns, on the torch thread)
        self.launched = launched
        # whether a batch of these request ids is all the daemon has in flight: only then does
        # a decode wait idle for them (KV_LAUNCHED is of use to an idle decode alone)
        self.quiet = quiet
        self.max_tokens = max_tokens
        # --pipeline-forwards: the next forward starts before this one's requests are answered
        self.pipelined = pipelined
        self.chunk = chunk or max_tokens  # most positions of one prompt in one forward
        self.forwards = 0  # batches run since start
        self.prompts = 0  # prompts prefilled since start
        self._queue: deque[_Job] = deque()
        self._wake = asyncio.Event()
        # when the last forward returned (monotonic ns), while more was queued behind it: the
        # next forward's `queued_gap_ms` (the device idle between them, for this daemon)
        self._last_done: int | None = None
        self._running: _Running | None = None  # the forward awaited now

    def submit(
        self,
        request_id: str,
        prompt: list[int],
        blocks: list[int],
        sampling: SamplingParams,
        event_slot: int,
        start: int = 0,
        marks: Marks | None = None,
    ) -> asyncio.Future[tuple[FirstToken, int]]:
        """Queue the prompt for the next batch: a future of (its first token, the number of
        requests that shared its (last) forward) once its last chunk has run, or of
        RequestFailed for this request. Its blocks already hold the K/V of its first `start`
        positions (< len(prompt): one position at least is computed, to sample from; 0 for a
        prompt that asks for prompt logprobs, whose every position is computed). Cancel the
        future if the request goes away: a prompt not yet run is then skipped. `marks` get
        forward_started (its first forward began) and forward_done (its last one returned)."""
        if not 0 <= start < len(prompt):
            raise ValueError(f"start {start} outside a prompt of {len(prompt)} tokens")
        if start and sampling.prompt_logprobs is not None:
            raise ValueError("a prompt that asks for prompt logprobs is computed from position 0")
        future: asyncio.Future[tuple[FirstToken, int]] = asyncio.get_running_loop().create_future()
        job = _Job(request_id, prompt, blocks, sampling, event_slot, future, start, marks)
        self._queue.append(job)
        self._wake.set()
        return future

    async def run(self) -> None:
        """Forever: take what is queued (within the budget), run it, answer each request.
        `pipelined`: the next batch goes to the torch thread as soon as a forward returns,
        before that forward's requests are answered, so their first tokens, KV_READYs and
        relays run on this loop while the device computes the next forward, not between the
        two; else it is taken once they are answered."""
        try:
            while True:
                if not self._wake.is_set():  # the queue ran dry: the next batch waits for none
                    self._last_done = None
                    await self._wake.wait()
                self._wake.clear()  # set: a prompt came while the last forward's were answered
                current = self._launch(self._take())
                while current is not None:
                    self._running = current
                    try:
                        result: list | BaseException = await current.future
                    except Exception as exc:  # the forward failed: its requests alone fail
                        result = exc
                    self._last_done = returned_ns = time.monotonic_ns()
                    self._requeue(current, result)  # its chunks take their turn as before
                    following = self._launch(self._take()) if self.pipelined else None
                    self._running = following
                    line = self._finish(current, result, returned_ns)
                    await asyncio.sleep(0)  # the first tokens go out before this line is written
                    if line is not None:
                        log.info("prefill_batch", **line)
                    if not self.pipelined:
                        following = self._running = self._launch(self._take())
                    current = following
        finally:
            stopped = RequestFailed(ErrorCode.SHUTTING_DOWN, "prefill daemon is shutting down")
            running = [job for job, _ in self._running.taken] if self._running else []
            for job in [*self._queue, *running]:
                _answer(job, stopped)
            self._queue.clear()

    def _take(self) -> list[tuple[_Job, Piece]]:
        """The queue's head in order while their next pieces (at most `chunk` positions each)
        fit `max_tokens` (the first always goes); jobs whose request was cancelled are dropped."""
        batch: list[tuple[_Job, Piece]] = []
        used = 0
        while self._queue:
            job = self._queue[0]
            if job.future.done():
                self._queue.popleft()
                continue
            piece = job.piece(self.chunk)
            n = piece.end - piece.start
            if batch and used + n > self.max_tokens:
                break
            batch.append((self._queue.popleft(), piece))
            used += n
        return batch

    def _launch(self, taken: list[tuple[_Job, Piece]]) -> _Running | None:
        """Send `taken` to the torch thread as one forward (None for an empty batch)."""
        if not taken:
            return None
        pieces = [p for _, p in taken]
        tokens = sum(p.end - p.start for p in pieces)
        ids = [j.request_id for j, _ in taken]
        started_ns = time.monotonic_ns()
        gap = None if self._last_done is None else round((started_ns - self._last_done) / 1e6, 3)
        for job, _ in taken:
            if job.marks is not None and "forward_started" not in job.marks:
                job.marks.stamp("forward_started", started_ns)
        on_launched = None
        if (
            self.launched is not None
            and self.producer.mailbox is not None
            and (self.quiet is None or self.quiet(ids))
        ):
            loop, tell = asyncio.get_running_loop(), self.launched

            def on_launched(rows: list[int]) -> None:  # torch thread
                queued, sent = time.monotonic_ns(), threading.Event()

                def send() -> None:  # on the loop
                    try:
                        tell([ids[i] for i in rows], queued)
                    finally:
                        sent.set()

                loop.call_soon_threadsafe(send)
                # wait with the GIL released until the loop has sent them: the draw below holds
                # the GIL while it waits for the GPU, and the frames would leave only after it
                sent.wait(LAUNCH_SEND_WAIT_S)

        try:
            future = self.rt.submit(
                run_prefill_batch,
                self.rt,
                pieces,
                self.producer,
                token_budget=max(self.max_tokens, tokens),
                launched=on_launched,
            )
        except Exception as exc:  # e.g. the executor shut down: this batch fails, not the task
            future = asyncio.get_running_loop().create_future()
            future.set_exception(exc)
        return _Running(taken, ids, tokens, started_ns, gap, future)

    def _requeue(self, running: _Running, result: list | BaseException) -> None:
        """A forward returned: each prompt it ran a chunk of (not its last) goes back to the end
        of the queue for its next piece."""
        if isinstance(result, BaseException):
            return
        for (job, piece), first in zip(running.taken, result, strict=True):
            if first is None:
                job.start = piece.end
                if not job.future.done():
                    self._queue.append(job)
                    self._wake.set()

    def _finish(
        self, running: _Running, result: list | BaseException, returned_ns: int
    ) -> dict | None:
        """Answer a forward's requests: each its first token (or its error; a chunk was queued
        again by `_requeue`). The forward's log line (None: it failed)."""
        taken, ids = running.taken, running.ids
        if isinstance(result, BaseException):
            log.error(
                "prefill_batch_failed",
                requests=len(taken),
                request_ids=ids[:_LOGGED_IDS],
                exc_info=result,
            )
            why = f"prefill forward failed: {type(result).__name__}: {result}"
            for job, _ in taken:
                _answer(job, RequestFailed(ErrorCode.INTERNAL, why))
            return None
        self.forwards += 1
        for (job, _), first in zip(taken, result, strict=True):
            if first is None:  # a chunk, queued again
                continue
            if isinstance(first, SamplingError):
                _answer(job, RequestFailed(ErrorCode.NUMERIC_ERROR, str(first)))
                continue
            self.prompts += 1
            if job.marks is not None:
                job.marks.stamp("forward_done", returned_ns)
            _answer(job, (first, len(taken)))
        return {
            "requests": len(taken),
            "tokens": running.tokens,
            "context_tokens": sum(p.start for _, p in taken),
            "forward_ms": round((returned_ns - running.started_ns) / 1e6, 3),
            "queued_gap_ms": running.gap,  # since the forward it queued behind returned
            "request_ids": ids[:_LOGGED_IDS],
        }


def _answer(job: _Job, result: tuple[FirstToken, int] | BaseException) -> None:
    if job.future.done():  # cancelled while its batch ran
        return
    if isinstance(result, BaseException):
        job.future.set_exception(result)
    else:
        job.future.set_result(result)
