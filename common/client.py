"""Client side of the daemons' sockets: the one GENERATE/ABORT request loop, and STATUS.

The client socket speaks the same frames as the link: GENERATE, then TOKENS… and FINISH (or ERROR)
for that request id; ABORT ends a request early; STATUS is answered by one STATUS_REPLY.

`Connection` is one connection to a prefill daemon that any number of requests share: every reply
names its request id, and frames are routed from the channel's read callback to each request's
queue (no task per frame). Opening and closing a Unix socket costs ~12 ms of CPU per request on
the sandboxed CI VM, so a long-lived client (the HTTP API) keeps one; `stream`, `generate` and
`status` below are its one-shot uses (the CLI, the demo, tests). An ERROR is `RequestFailed`; the
connection ending is ConnectionError for every request on it, and the next use reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from common.errors import PdkvError, ProtocolError
from common.protocol import (
    Abort,
    ConnectionClosed,
    Error,
    ErrorCode,
    Finish,
    Generate,
    Message,
    Status,
    StatusReply,
    Tokens,
    encode,
    join_queued,
)
from common.sampling_params import SamplingParams, TokenLogprob
from common.wire.channel import FrameChannel, connect

__all__ = [
    "Connection",
    "Finish",
    "RequestFailed",
    "Result",
    "Tokens",
    "generate",
    "status",
    "stream",
]

_Inbox = asyncio.Queue[Message | BaseException]

#: the idle watchdog looks at every request at least this often (and 4 times per its timeout)
WATCH_PERIOD_S = 1.0


def _period(timeout: float) -> float:
    """How often the watchdog looks for a request of `timeout`: a quarter of it, at most
    WATCH_PERIOD_S, at least a millisecond."""
    return max(min(timeout / 4, WATCH_PERIOD_S), 0.001)


@dataclass(slots=True, eq=False)
class _Request:
    """One request in flight on a connection: where its frames go, and its idle clock."""

    channel: FrameChannel
    inbox: _Inbox
    timeout: float
    last: float  # time.monotonic() of its last frame (or of its GENERATE)


class RequestFailed(PdkvError):
    """The daemon answered a request with ERROR; `code` is its ErrorCode, `reason` its message."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.reason = message
        self.request_id = request_id


@dataclass
class Result:
    """A finished request as the client saw it."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: Finish | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when sampling.logprobs is set
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1..


class Connection:
    """One connection to a prefill daemon's client socket, shared by concurrent requests.

    Contract: `stream()` yields one request's TOKENS then its FINISH, and RequestFailed on ERROR;
    closing it before FINISH sends ABORT (without awaiting, so a cancelled caller still sends
    it). `status()` asks STATUS on the same connection. The connection is opened by the first use
    and again by the first use after it ended.

    A request whose reader falls behind gets the TOKENS queued meanwhile as one message
    (`join_queued`), as the prefill merges a request's queued steps for its client: under load
    fewer, larger messages, each token once and in order.

    A request that gets no frame for its `timeout` seconds (counted from its last frame, or its
    GENERATE, whatever its reader does meanwhile) ends in TimeoutError, and ABORT goes to the
    daemon. One watchdog task per connection and event loop (`_watch`) finds it, rather than a
    timer per frame: with 256 requests in flight a timer armed and cancelled around every wait
    cost ~3.8 µs a frame (asyncio's timer heap), about half of what a frame cost the client.
    """

    def __init__(self, socket_path: str) -> None:
        self.path = socket_path
        self.connects = 0  # connections opened so far: a change means a new daemon may answer
        self._channel: FrameChannel | None = None
        self._lock = asyncio.Lock()
        self._inboxes: dict[str, _Request] = {}
        self._status_waiters: deque[tuple[FrameChannel, asyncio.Future[StatusReply]]] = deque()
        self._readers: set[asyncio.Task[None]] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._watch_period = math.inf  # how long the watchdog sleeps between looks

    async def _connected(self) -> FrameChannel:
        async with self._lock:
            if self._channel is None or self._channel.closed:
                channel = await connect(self.path)
                self._channel = channel
                self.connects += 1
                reader = asyncio.create_task(self._read(channel), name="prefill-connection")
                self._readers.add(reader)
                reader.add_done_callback(self._readers.discard)
            return self._channel

    async def _read(self, channel: FrameChannel) -> None:
        why: BaseException = ConnectionError("the prefill daemon closed the connection")
        try:
            await channel.dispatch(lambda msg: self._route(channel, msg))
        except (RequestFailed, ConnectionClosed, OSError) as exc:  # RequestFailed: an ERROR
            why = exc  # about the connection itself; ConnectionClosed: EOF between frames
        except Exception as exc:
            why = ConnectionError(f"connection to the prefill daemon ended: {exc!r}")
        finally:
            channel.close()
            if self._channel is channel:
                self._channel = None
            for entry in list(self._inboxes.values()):
                if entry.channel is channel:
                    entry.inbox.put_nowait(why)
            for ch, fut in self._status_waiters:
                if ch is channel and not fut.done():
                    fut.set_exception(why)

    def _route(self, channel: FrameChannel, msg: Message) -> None:
        if isinstance(msg, StatusReply):
            while self._status_waiters:
                ch, fut = self._status_waiters.popleft()
                if ch is channel and not fut.done():
                    fut.set_result(msg)
                    return
            return
        rid = getattr(msg, "request_id", None)
        if isinstance(msg, Error) and rid is None:  # the daemon refuses the connection; it ends
            raise RequestFailed(msg.code, msg.message, None)
        if not isinstance(msg, Tokens | Finish | Error):
            raise ProtocolError(f"unexpected {msg.TYPE.name} on the client socket")
        entry = self._inboxes.get(rid)  # type: ignore[arg-type]
        if entry is not None:  # else: a request that ended here already (late frames)
            entry.inbox.put_nowait(msg)
            entry.last = time.monotonic()

    async def status(self, timeout: float = 2.0) -> StatusReply:
        """The daemon's STATUS_REPLY; a stale connection (the daemon restarted) is re-opened
        once, since STATUS has no effect to repeat."""
        for attempt in (0, 1):
            before = self.connects
            async with asyncio.timeout(timeout):
                channel = await self._connected()
                reused = self.connects == before
                fut: asyncio.Future[StatusReply] = asyncio.get_running_loop().create_future()
                self._status_waiters.append((channel, fut))
                try:
                    channel.write_nowait(encode(Status()))
                    return await fut
                except (ConnectionError, ConnectionClosed):
                    if attempt or not reused:
                        raise
                finally:
                    with contextlib.suppress(ValueError):
                        self._status_waiters.remove((channel, fut))
        raise AssertionError("unreachable")

    async def stream(
        self,
        *,
        sampling: SamplingParams | None = None,
        prompt: str | None = None,
        prompt_tokens: list[int] | None = None,
        request_id: str | None = None,
        timeout: float | None = 120.0,
        text_deltas: bool = True,
    ) -> AsyncIterator[Tokens | Finish]:
        """Run one GENERATE; TimeoutError (and ABORT to the daemon) when no frame comes for
        `timeout` seconds (None: no limit). ValueError for a timeout that is not positive.

        With `text_deltas` (GENERATE's `stream`), each TOKENS carries its new text; without,
        TOKENS carry ids only and FINISH the whole text.
        """
        if timeout is None:
            timeout = math.inf
        elif not timeout > 0:  # NaN too
            raise ValueError(f"timeout must be positive seconds or None, got {timeout!r}")
        rid = request_id or uuid.uuid4().hex[:16]
        channel = self._channel
        if channel is None or channel.closed:  # no timer when it is open (the common case)
            async with asyncio.timeout(None if math.isinf(timeout) else timeout):
                channel = await self._connected()
        if rid in self._inboxes:
            raise RequestFailed(ErrorCode.BAD_REQUEST, "request id already in flight", rid)
        inbox: _Inbox = asyncio.Queue()
        self._inboxes[rid] = _Request(channel, inbox, timeout, time.monotonic())
        self._watch_for(_period(timeout))
        done = False
        held: Message | BaseException | None = None  # taken from the inbox, not yet handled
        try:
            channel.write_nowait(
                encode(
                    Generate(
                        sampling=sampling or SamplingParams(),
                        prompt=prompt,
                        prompt_tokens=prompt_tokens,
                        request_id=rid,
                        stream=text_deltas,
                    )
                )
            )
            while not done:
                if held is None:
                    msg = await inbox.get()  # TimeoutError from _watch: no frame came in time
                else:
                    msg, held = held, None
                if isinstance(msg, Tokens) and not inbox.empty():  # the reader fell behind
                    msg, held = join_queued(msg, inbox)
                if isinstance(msg, BaseException):
                    done = not isinstance(msg, TimeoutError)  # timed out: ABORT, below
                    raise msg
                if isinstance(msg, Error):
                    done = True
                    raise RequestFailed(msg.code, msg.message, msg.request_id)
                done = isinstance(msg, Finish)
                yield msg  # type: ignore[misc]
        finally:
            del self._inboxes[rid]
            if not self._inboxes and self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog, self._watch_period = None, math.inf
            if not done:
                with contextlib.suppress(OSError):
                    channel.write_nowait(encode(Abort(request_id=rid)))

    def _watch_for(self, period: float) -> None:
        """A watchdog that looks at least every `period` runs in this loop: the running one, or
        a new one (in place of one of another loop, or of one asleep for longer)."""
        watchdog, loop = self._watchdog, asyncio.get_running_loop()
        if watchdog is not None and not watchdog.done() and watchdog.get_loop() is loop:
            if period >= self._watch_period:
                return
            watchdog.cancel()  # asleep for longer than this request's timeout allows
        self._watchdog = loop.create_task(self._watch(), name="prefill-connection-watch")
        self._watch_period = period  # until it looks at every request: a burst starts one

    async def _watch(self) -> None:
        """While requests are in flight: end each one whose inbox has stayed empty for its
        timeout since its last frame (or its GENERATE) with TimeoutError. Looks every `_period`
        of the shortest timeout."""
        while self._inboxes:
            self._watch_period = min(_period(e.timeout) for e in self._inboxes.values())
            await asyncio.sleep(self._watch_period)
            now = time.monotonic()
            for entry in list(self._inboxes.values()):
                idle = now - entry.last
                if idle >= entry.timeout and entry.inbox.empty():
                    entry.inbox.put_nowait(TimeoutError(f"no frame for {idle:.3g} s"))
                    entry.last = math.inf  # told once; its stream ends with it

    def close(self) -> None:
        """Close the connection; its requests end with ConnectionError (the daemon aborts them)."""
        if self._channel is not None:
            self._channel.close()

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await asyncio.gather(*self._readers, return_exceptions=True)


async def stream(
    socket_path: str,
    *,
    prompt: str | None = None,
    prompt_tokens: list[int] | None = None,
    sampling: SamplingParams | None = None,
    request_id: str | None = None,
    timeout: float | None = 120.0,
    text_deltas: bool = True,
) -> AsyncIterator[Tokens | Finish]:
    """Send one GENERATE on a connection of its own and yield its TOKENS then FINISH;
    RequestFailed on ERROR. Closing the generator early aborts the request (ABORT, and the
    connection closes)."""
    async with (
        Connection(socket_path) as conn,
        contextlib.aclosing(
            conn.stream(
                prompt=prompt,
                prompt_tokens=prompt_tokens,
                sampling=sampling,
                request_id=request_id,
                timeout=timeout,
                text_deltas=text_deltas,
            )
        ) as msgs,
    ):
        async for msg in msgs:
            yield msg


async def generate(socket_path: str, **kwargs) -> Result:  # type: ignore[no-untyped-def]
    """Run one request to completion (see `stream` for the arguments); the text is sent whole
    at the end unless `text_deltas=True` is given."""
    kwargs.setdefault("text_deltas", False)
    result: Result | None = None
    async for msg in stream(socket_path, **kwargs):
        if result is None:
            result = Result(request_id=msg.request_id)
        if isinstance(msg, Tokens):
            result.tokens.extend(msg.tokens)
            result.text += msg.text
            result.logprobs.extend(msg.logprobs or [])
            result.prompt_logprobs.extend(msg.prompt_logprobs or [])
        else:
            result.text += msg.text
            result.finish = msg
    assert result is not None
    return result


async def status(socket_path: str, timeout: float = 2.0) -> StatusReply:
    """Ask a daemon (prefill client socket or decode link socket) for its status."""
    channel = await asyncio.wait_for(connect(socket_path), timeout)
    try:
        await channel.send(Status())
        reply = await asyncio.wait_for(channel.recv(), timeout)
    finally:
        channel.close()
    if not isinstance(reply, StatusReply):
        raise ProtocolError(f"expected STATUS_REPLY, got {reply.TYPE.name}")
    return reply
