"""common.client.Connection against a scripted prefill on a real Unix socket: a request that gets no
frame for its timeout ends in TimeoutError and ABORT (and only that one, on a shared connection),
a frame restarts its idle clock, a reader slower than the timeout never times out while frames
come, a reader that falls behind gets the TOKENS queued meanwhile as one message, a short timeout
is kept beside long ones and beside none, and the connection's watchdog task ends with its last
request."""

from __future__ import annotations

import asyncio
import math
import struct
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from common import client
from common.protocol import Abort, Finish, Generate, Tokens, Usage, decode, encode, join_queued
from tests.support.wait import until

TIMEOUT = 0.4
SEEN: list[tuple[str, str]] = []  # (frame type, request id) as the scripted prefill read them
# what the scripted prefill does for a request, by its first prompt token
STALL, DRIP, BURST = 1, 2, 3


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer each GENERATE by its first prompt token: STALL sends nothing; DRIP sends a token
    every TIMEOUT/3, six in all (two timeouts long), then FINISH; BURST sends ten tokens and
    FINISH at once."""
    tasks = []
    try:
        while True:
            head = await reader.readexactly(20)
            size = sum(struct.unpack("!4sHHIII", head)[3:])
            msg = decode(head + await reader.readexactly(size))
            SEEN.append((type(msg).__name__, getattr(msg, "request_id", "")))
            if isinstance(msg, Generate):
                tasks.append(asyncio.create_task(_answer(writer, msg)))
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        for task in tasks:
            task.cancel()
        writer.close()


async def _answer(writer: asyncio.StreamWriter, msg: Generate) -> None:
    rid, how = msg.request_id, msg.prompt_tokens[0]
    if how == STALL:
        return
    count, gap = (6, TIMEOUT / 3) if how == DRIP else (10, 0.0)
    for i in range(count):
        if gap:
            await asyncio.sleep(gap)
        writer.write(encode(Tokens(request_id=rid, tokens=[i], text=f"t{i} ")))
    usage = Usage(prompt_tokens=1, completion_tokens=count)
    writer.write(encode(Finish(request_id=rid, reason="length", usage=usage)))


@asynccontextmanager
async def _prefill(tmp_path: Path) -> AsyncIterator[str]:
    SEEN.clear()
    path = str(tmp_path / "p.sock")
    server = await asyncio.start_unix_server(_serve, path)
    try:
        yield path
    finally:
        server.close()
        await server.wait_closed()


async def _tokens(
    conn: client.Connection,
    how: int,
    rid: str,
    pause: float = 0.0,
    timeout: float | None = TIMEOUT,
) -> list[int]:
    got = []
    async for msg in conn.stream(prompt_tokens=[how], request_id=rid, timeout=timeout):
        if isinstance(msg, Tokens):
            got += msg.tokens
            await asyncio.sleep(pause)  # a consumer slower than the timeout
    return got


def _watchdogs() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "prefill-connection-watch"]


async def _timed(f: Callable[[], object]) -> float:
    start = time.monotonic()
    await f()  # type: ignore[misc]
    return time.monotonic() - start


async def test_a_silent_request_times_out_and_only_it(tmp_path: Path) -> None:
    async with _prefill(tmp_path) as path, client.Connection(path) as conn:
        start = time.monotonic()
        together = asyncio.gather(
            _tokens(conn, STALL, "silent"),
            _tokens(conn, DRIP, "drip"),
            _tokens(conn, BURST, "burst"),
            return_exceptions=True,
        )
        results = await asyncio.wait_for(together, 10 * TIMEOUT)  # a missed timeout: fail
        silent, drip, burst = results
        assert isinstance(silent, TimeoutError), silent
        # the drip lasted two timeouts: each frame restarted its idle clock
        assert drip == list(range(6)) and time.monotonic() - start >= 1.5 * TIMEOUT
        assert burst == list(range(10))
        await asyncio.sleep(0)
        assert not [t for t in _watchdogs() if not t.done()]  # gone with the last request


async def test_the_timeout_comes_after_the_timeout_and_within_a_watch_period(
    tmp_path: Path,
) -> None:
    async with _prefill(tmp_path) as path, client.Connection(path) as conn:

        async def silent() -> None:
            with pytest.raises(TimeoutError):  # ours, not wait_for's: that one comes later
                await asyncio.wait_for(_tokens(conn, STALL, "silent"), 10 * TIMEOUT)

        took = await _timed(silent)
        assert TIMEOUT <= took < 2 * TIMEOUT + 0.3  # a watch period is a quarter of it


async def test_a_slow_consumer_with_frames_coming_does_not_time_out(tmp_path: Path) -> None:
    async with _prefill(tmp_path) as path, client.Connection(path) as conn:
        # a frame every third of a timeout, each read 0.6 timeouts after the one before: the
        # reader is behind for two timeouts, the daemon never silent for one
        assert await _tokens(conn, DRIP, "slow", pause=0.6 * TIMEOUT) == list(range(6))


async def test_a_reader_behind_gets_the_queued_tokens_as_one_message(tmp_path: Path) -> None:
    async with _prefill(tmp_path) as path, client.Connection(path) as conn:
        seen: list[tuple[str, list[int], str]] = []
        async for msg in conn.stream(prompt_tokens=[BURST], request_id="behind", timeout=TIMEOUT):
            tokens = msg.tokens if isinstance(msg, Tokens) else []
            seen.append((type(msg).__name__, tokens, msg.text))
            await asyncio.sleep(0.05)  # what comes meanwhile queues
        *tokens, finish = seen
        assert finish == ("Finish", [], "")
        assert len(tokens) < 10  # merged: however the frames came, some queued behind others
        assert [t for _, ts, _ in tokens for t in ts] == list(range(10))  # each once, in order
        assert "".join(text for *_, text in tokens) == "".join(f"t{i} " for i in range(10))


async def test_a_new_request_after_the_last_one_gets_a_watchdog_again(tmp_path: Path) -> None:
    async with _prefill(tmp_path) as path, client.Connection(path) as conn:
        assert await _tokens(conn, BURST, "one") == list(range(10))
        with pytest.raises(TimeoutError):
            await _tokens(conn, STALL, "two")
        assert await _tokens(conn, BURST, "three") == list(range(10))


async def test_a_timed_out_request_is_aborted_at_the_daemon(tmp_path: Path) -> None:
    async with _prefill(tmp_path) as path, client.Connection(path) as conn:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(_tokens(conn, STALL, "silent"), 10 * TIMEOUT)
        await until(lambda: len(SEEN) >= 2, timeout=5, what="a second frame at the daemon")
        assert SEEN == [("Generate", "silent"), ("Abort", "silent")]


async def test_a_short_timeout_beside_a_long_one_and_none_is_kept(tmp_path: Path) -> None:
    """The watchdog looks every quarter of the shortest timeout in flight, however long it was
    asleep when the short one came, and a request without a timeout does not stop it."""
    async with _prefill(tmp_path) as path, client.Connection(path) as conn:
        long = asyncio.create_task(_tokens(conn, STALL, "long", timeout=100.0))
        endless = asyncio.create_task(_tokens(conn, STALL, "endless", timeout=None))
        await asyncio.sleep(0.1)  # the watchdog asleep for a second: the period of 100 s

        async def short() -> None:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(_tokens(conn, STALL, "short", timeout=0.1), 5)

        assert await _timed(short) < 0.5  # not the second the watchdog was asleep for
        assert not long.done() and not endless.done()
        for task in (long, endless):
            task.cancel()
        await asyncio.gather(long, endless, return_exceptions=True)

        def aborted() -> set[str]:
            return {rid for kind, rid in SEEN if kind == Abort.__name__}

        await until(lambda: len(aborted()) >= 3, timeout=5, what="three ABORTs at the daemon")
        assert aborted() == {"short", "long", "endless"}  # cancelled ones are aborted too


@pytest.mark.parametrize("timeout", [0, -1.0, math.nan])
async def test_a_timeout_that_is_not_positive_is_refused(tmp_path: Path, timeout: float) -> None:
    async with _prefill(tmp_path) as path, client.Connection(path) as conn:
        with pytest.raises(ValueError, match="timeout must be positive"):
            await _tokens(conn, BURST, "bad", timeout=timeout)
        assert SEEN == []  # nothing was sent


def _queue(*msgs: Tokens | Finish) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    for m in msgs:
        q.put_nowait(m)
    return q


def test_merging_keeps_logprobs_aligned_and_frames_it_cannot_join_apart() -> None:
    lp = [[7, -0.5, []]]
    a = Tokens(request_id="r", tokens=[1], text="a", logprobs=lp)
    b = Tokens(request_id="r", tokens=[2], text="b", logprobs=[[8, -0.25, []]])
    plain = Tokens(request_id="r", tokens=[3], text="c")
    q = _queue(b, plain, Tokens(request_id="r", tokens=[4]))
    merged, held = join_queued(a, q)
    assert (merged.tokens, merged.text) == ([1, 2], "ab")
    assert merged.logprobs == [[7, -0.5, []], [8, -0.25, []]]
    assert held == plain and q.qsize() == 1  # one with logprobs and one without stay apart
    prompt = Tokens(request_id="r", tokens=[], prompt_logprobs=lp)
    assert join_queued(prompt, _queue(plain)) == (prompt, None)  # prompt logprobs: never merged
    big = Tokens(request_id="r", tokens=list(range(300)))
    assert join_queued(big, _queue(big)) == (big, big)  # past 512 tokens: apart
    done = Finish(
        request_id="r", reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1)
    )
    assert join_queued(plain, _queue(done)) == (plain, done)
