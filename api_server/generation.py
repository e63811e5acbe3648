"""A request's runs through the daemons, as the HTTP layer needs them: Pieces (text deltas with
`stop` strings cut out, and the logprobs of their tokens when asked), then a Done with the finish reason and usage, for each of its prompts (`run_all`
runs them at once and merges their events, tagged with each prompt's index). Failures become
ApiErrors.

A request that meets one of its stop strings ends there: the generator closes the daemon stream,
which sends ABORT, so the daemons free its blocks at once instead of generating to max_tokens.
Closing this generator early (a client that went away) does the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from api_server.errors import ApiError, bad_field, from_daemon, timed_out, unavailable
from api_server.metrics import Metrics
from api_server.prompts import MAX_PROMPTS, Prompt
from api_server.schemas import seeded
from api_server.tokens import PromptCounter
from api_server.tools.marker_text import MarkerText
from common import client
from common.errors import PdkvError
from common.sampling_params import SamplingParams, TokenLogprob

log = structlog.get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class Job:
    """What one HTTP request asks the daemons for. `request_id` is also the daemons' id."""

    request_id: str
    sampling: SamplingParams
    prompt: str | None = None
    prompt_tokens: list[int] | None = None
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    max_tokens_param: str = "max_tokens"  # the request's name for sampling.max_tokens
    # special-token ids whose text the answer must show (a tool parser's markers): the API
    # decodes the ids itself (api_server.tools.marker_text); empty: the daemons' text
    markers: dict[int, str] = field(default_factory=dict)


def jobs(rid: str, prompts: list[Prompt], params: SamplingParams, n: int, **kw: Any) -> list[Job]:
    """One Job per choice: choice i * n + j is prompt i's j-th (seeded by `schemas.seeded`);
    its daemon request id is `rid`, or `rid-<choice>` when there are several."""
    count = len(prompts) * n
    if count > MAX_PROMPTS:
        raise bad_field("n", f"prompts x n is {count}, more than the {MAX_PROMPTS} choices allowed")
    return [
        Job(
            request_id=rid if count == 1 else f"{rid}-{i * n + j}",
            sampling=seeded(params, j),
            prompt=p.text,
            prompt_tokens=p.tokens,
            **kw,
        )
        for i, p in enumerate(prompts)
        for j in range(n)
    ]


@dataclass(frozen=True)
class Piece:
    """Text of a request's new tokens (possibly empty) and their logprob entries; `prompt`
    holds prompt logprob entries (they come before the first token)."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Done:
    """The end of a request: OpenAI's finish_reason (`stop` or `length`) and its usage."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, reused from the prefill's prefix cache


class StopCutter:
    """Finds the first stop string in a stream of text deltas and holds back any tail of the
    text that could still be the start of one, so no part of a stop string is ever emitted."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, True when a stop string was found: the text ends before it)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, at the end of a request that met no stop string."""
        text, self.held = self.held, ""
        return text


async def run(
    job: Job,
    *,
    conn: client.Connection,
    timeout: float,
    retry_after: int,
    metrics: Metrics,
    counter: PromptCounter,
) -> AsyncIterator[Piece | Done]:
    """Yield `job`'s Pieces (each with text or logprobs) then one Done; ApiError on failure.

    Non-streamed jobs without stop strings ask the daemon for the whole text at the end (one
    detokenization); the rest ask for text with every TOKENS frame.
    """
    cutter = StopCutter(job.stops)
    marked = MarkerText(counter.decode, job.markers) if job.markers else None
    started = last = time.perf_counter()
    completion = 0
    stream = conn.stream(
        prompt=job.prompt,
        prompt_tokens=job.prompt_tokens,
        sampling=job.sampling,
        request_id=job.request_id,
        timeout=timeout,
        text_deltas=job.stream or bool(job.stops),
    )
    metrics.inflight.inc()
    try:
        async with contextlib.aclosing(stream) as msgs:
            async for msg in msgs:
                now = time.perf_counter()
                if isinstance(msg, client.Tokens) and msg.tokens:
                    if completion == 0:
                        metrics.ttft.observe(now - started)
                    else:
                        metrics.itl.observe((now - last) / len(msg.tokens))
                    last = now
                    completion += len(msg.tokens)
                text, hit = cutter.feed(msg.text if marked is None else _marked(marked, msg))
                lps, prompt = [], []
                if isinstance(msg, client.Tokens):
                    lps, prompt = msg.logprobs or [], msg.prompt_logprobs or []
                if text or lps or prompt:
                    yield Piece(text, lps, prompt)
                if hit:
                    prompt = counter.count(job.prompt, job.prompt_tokens)
                    yield Done("stop", prompt, completion)
                    return
                if isinstance(msg, client.Finish):
                    if tail := cutter.flush():
                        yield Piece(tail)
                    if handoff_us := msg.timings.get("handoff_us"):  # 0: ended before a handoff
                        metrics.handoff.observe(handoff_us / 1e6)
                    reason = "length" if msg.reason == "length" else "stop"
                    u = msg.usage
                    log.info(
                        "request_finished",
                        request_id=job.request_id,
                        prefill=conn.path,
                        decode=msg.decode or None,
                        reason=reason,
                        completion_tokens=u.completion_tokens,
                    )
                    yield Done(reason, u.prompt_tokens, u.completion_tokens, u.cached_tokens)
                    return
    except client.RequestFailed as exc:
        raise from_daemon(
            exc.code, exc.reason, retry_after=retry_after, max_tokens_param=job.max_tokens_param
        ) from None
    except TimeoutError:
        raise timed_out(timeout) from None
    except (OSError, PdkvError) as exc:
        raise unavailable(
            f"the prefill daemon at {conn.path} is not answering ({type(exc).__name__}: {exc})",
            retry_after=retry_after,
        ) from None
    finally:
        metrics.inflight.dec()
    raise ApiError(
        503,
        "the prefill daemon ended the request without FINISH",
        type="service_unavailable",
        code="unavailable",
    )


def _marked(marked: MarkerText, msg: client.Tokens | client.Finish) -> str:
    """The text of `msg` with the markers in it: its ids' (TOKENS), the rest (FINISH)."""
    return marked.feed(msg.tokens) if isinstance(msg, client.Tokens) else marked.flush()


async def run_all(jobs: list[Job], **kw: Any) -> AsyncIterator[tuple[int, Piece | Done]]:
    """Run `jobs` (the arguments of `run` in `kw`) at once; yield (index, event) as each
    comes, until every job's Done. The first failure cancels the rest (their requests are
    aborted) and is raised; so is closing this generator early."""
    if len(jobs) == 1:
        async with contextlib.aclosing(run(jobs[0], **kw)) as events:
            async for item in events:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Piece | Done | Exception]] = asyncio.Queue()

    async def pump(index: int, job: Job) -> None:
        try:
            async with contextlib.aclosing(run(job, **kw)) as events:
                async for item in events:
                    queue.put_nowait((index, item))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    left = len(jobs)
    try:
        while left:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if isinstance(item, Done):
                left -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
