"""The load side of bench/serve.py: the drawn workload, the open-loop driver, the metrics.

A workload is a list of requests drawn once from a seed: Poisson arrival times at a given rate
(exponential gaps; rate inf = every request at time 0), prompt and output lengths uniform in their
ranges, prompts of random token ids. The same workload is replayed against every target, so the
targets see identical work.

The driver is open-loop: each request is sent at its arrival time whatever the others are doing.
Latencies count from the request's scheduled arrival, so a client that falls behind shows in them
instead of hiding (no coordinated omission). The send itself is on time to within microseconds
(`until`): the event loop's timers wake up to ~1 ms late, and every latency would count that;
how late each request actually went is kept (`sent`) and summarized (`send_lag_ms`). A target is one function, `open_stream(spec)`, that
yields one request's output as it arrives, each chunk timestamped by the driver on arrival: token
ids, or text for a target that streams text (the HTTP API), then for those a `Usage` with the
target's own count of output tokens; a target that knows the server's own timings of a request
(the daemons' FINISH) yields them last as `ServerTimings`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: sent `arrival_s` after the start, `output_len` tokens asked."""

    index: int
    arrival_s: float
    prompt: list[int]
    output_len: int
    after: int | None = None  # a later turn: sent once request `after` (its previous turn) ended
    turn: int = 0  # its turn in a multi-turn conversation (0: the first, or no conversation)


@dataclass
class RequestRecord:
    """What the client saw of one request; times are seconds from the start of the run."""

    index: int
    prompt_len: int
    output_len: int
    start: float = 0.0  # when it was due (its arrival, or its previous turn's end)
    sent: float = 0.0  # when it was sent (`start` plus the client's own lag)
    turn: int = 0
    token_times: list[float] = field(default_factory=list)  # one per frame of tokens or text
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # what a text target streamed
    usage_tokens: int | None = None  # a text target's own count (Usage)
    server: dict[str, float] = field(default_factory=dict)  # the server's timings (FINISH)
    end: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens == self.output_len

    @property
    def output_tokens(self) -> int:
        return len(self.tokens) if self.usage_tokens is None else self.usage_tokens

    def ttft(self) -> float:
        return self.token_times[0] - self.start

    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    def to_json(self) -> dict:
        ok = self.ok and bool(self.token_times)
        return {
            "index": self.index,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "output_tokens": self.output_tokens,
            "ok": self.ok,
            "error": self.error,
            "start_s": self.start,
            "sent_s": self.sent,
            "turn": self.turn,
            "ttft_ms": self.ttft() * 1e3 if ok else None,
            "e2e_ms": (self.end - self.start) * 1e3,
            "itl_ms": [x * 1e3 for x in self.itls()],
            "tokens": self.tokens,
            "text": self.text,
            "server_timings": self.server,
        }


def parse_range(text: str) -> tuple[int, int]:
    """'MIN:MAX' (or one number) -> (MIN, MAX), 1 <= MIN <= MAX; ValueError otherwise."""
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise ValueError(f"range {text!r} must be MIN:MAX with 1 <= MIN <= MAX")
    return a, b


def make_workload(
    n: int,
    rate: float,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab: int,
    seed: int,
) -> list[RequestSpec]:
    """`n` requests drawn from `seed`: Poisson arrivals at `rate`/s (inf: all at 0), lengths
    uniform in the inclusive ranges, prompt ids uniform in [0, vocab). Lengths and prompts do
    not depend on the rate, so a sweep varies only the arrivals."""
    lengths = random.Random(seed)
    gaps = random.Random(seed + 1)
    specs, t = [], 0.0
    for i in range(n):
        p, o = lengths.randint(*prompt_len), lengths.randint(*output_len)
        prompt = [lengths.randrange(vocab) for _ in range(p)]
        specs.append(RequestSpec(i, t, prompt, o))
        if not math.isinf(rate):
            t += gaps.expovariate(rate)
    return specs


@dataclass(frozen=True)
class Usage:
    """A text target's count of a request's output tokens (the API's usage chunk); it stands for
    the count of ids, which such a target does not show. Not timestamped: it carries no output."""

    completion_tokens: int


@dataclass(frozen=True)
class ServerTimings:
    """The server's own timings of a request, in the units their names say (`*_us`, `*_ms`):
    the daemons' FINISH `timings`. Not timestamped: it carries no output."""

    values: dict[str, float]


Chunk = list[int] | str | Usage | ServerTimings
OpenStream = Callable[[RequestSpec], AsyncIterator[Chunk]]


async def run_load(
    specs: Sequence[RequestSpec], open_stream: OpenStream, *, label: str, progress_s: float = 5.0
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time through `open_stream`, concurrently; return the
    records (in workload order) and the run's duration (start → last request done).

    A request that raises is recorded with its error and does not stop the others. Every
    `progress_s` seconds a progress line goes to stderr."""
    t0 = time.perf_counter()
    records = [
        RequestRecord(s.index, len(s.prompt), s.output_len, start=s.arrival_s, turn=s.turn)
        for s in specs
    ]
    ended = {s.index: asyncio.Event() for s in specs}

    async def one(spec: RequestSpec, rec: RequestRecord) -> None:
        await until(t0 + spec.arrival_s)
        if spec.after is not None:  # a later turn waits for the one before
            await ended[spec.after].wait()
            rec.start = time.perf_counter() - t0
        rec.sent = time.perf_counter() - t0
        try:
            async for chunk in open_stream(spec):
                if isinstance(chunk, Usage):
                    rec.usage_tokens = chunk.completion_tokens
                    continue
                if isinstance(chunk, ServerTimings):
                    rec.server = chunk.values
                    continue
                rec.token_times.append(time.perf_counter() - t0)
                if isinstance(chunk, str):
                    rec.text += chunk
                else:
                    rec.tokens.extend(chunk)
        except Exception as e:  # a failed request is a result, not a crash of the bench
            rec.error = f"{type(e).__name__}: {e}"
        rec.end = time.perf_counter() - t0
        ended[spec.index].set()

    tasks = [asyncio.create_task(one(s, r)) for s, r in zip(specs, records, strict=True)]
    reporter = asyncio.create_task(_progress(records, tasks, t0, label, progress_s))
    try:
        await asyncio.gather(*tasks)
    finally:
        reporter.cancel()
    return records, max((r.end for r in records), default=0.0)


#: the last stretch before a request is due is spent yielding to the loop, not in a timer
SPIN_S = 0.002


async def until(due: float) -> None:
    """Return at `due` (time.perf_counter() seconds) to within a loop turn: a timer for all but
    the last SPIN_S (the loop's timers fire up to ~1 ms late: epoll's millisecond timeout),
    then yields to the loop, which goes on reading other requests' frames meanwhile."""
    if (left := due - time.perf_counter()) > SPIN_S:
        await asyncio.sleep(left - SPIN_S)
    while time.perf_counter() < due:
        await asyncio.sleep(0)


async def _progress(
    records: list[RequestRecord], tasks: list[asyncio.Task], t0: float, label: str, every: float
) -> None:
    while True:
        await asyncio.sleep(every)
        now = time.perf_counter() - t0
        done = sum(t.done() for t in tasks)
        sent = sum(r.start <= now for r in records)
        tokens = sum(r.output_tokens for r in records)
        print(
            f"  [{label}] {now:6.1f} s: {done}/{len(tasks)} done, "
            f"{sent - done} in flight, {tokens} tokens",
            file=sys.stderr,
            flush=True,
        )


def _dist(xs: Sequence[float], scale: float = 1e3) -> dict[str, float | None]:
    """mean/p50/p99 of `xs` × `scale` (default: s → ms; numpy's linear interpolation); None
    for an empty sample."""
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(xs) * scale
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(records: Sequence[RequestRecord], duration: float) -> dict:
    """Counts, throughput and the latency distributions (ms) of one run.

    TTFT: arrival → first token (or text chunk). ITL: between consecutive frames (chunks) of a
    request, all requests pooled. TPOT: per request (E2E − TTFT) / (tokens − 1). E2E: arrival → last frame."""
    ok = [r for r in records if r.ok and r.token_times]
    out_tokens = sum(r.output_tokens for r in records)
    per = duration if duration > 0 else math.inf
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_len for r in records),
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / per,
        "output_throughput": out_tokens / per,
        "ttft_ms": _dist([r.ttft() for r in ok]),
        "itl_ms": _dist([x for r in ok for x in r.itls()]),
        "tpot_ms": _dist(
            [
                (r.end - r.start - r.ttft()) / (r.output_tokens - 1)
                for r in ok
                if r.output_tokens > 1
            ]
        ),
        "e2e_ms": _dist([r.end - r.start for r in ok]),
        "second_token_ms": _dist([r.itls()[0] for r in ok if len(r.token_times) > 1]),
        "send_lag_ms": _dist([r.sent - r.start for r in records if r.sent]),
        "server_timings": _server_timings(ok),
        "ttft_ms_by_turn": _by_turn(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def _by_turn(records: Sequence[RequestRecord]) -> dict[int, dict[str, float | None]]:
    """TTFT (ms) per turn of multi-turn conversations ({} for other workloads)."""
    turns = sorted({r.turn for r in records})
    if turns in ([], [0]):
        return {}
    return {t: _dist([r.ttft() for r in records if r.turn == t]) for t in turns}


def _server_timings(records: Sequence[RequestRecord]) -> dict[str, dict[str, float | None]]:
    """Per numeric timing the server reported (in its own unit), its mean/p50/p99 over the
    requests that reported it."""
    keys = sorted({k for r in records for k, v in r.server.items() if isinstance(v, int | float)})
    return {k: _dist([r.server[k] for r in records if k in r.server], scale=1.0) for k in keys}
