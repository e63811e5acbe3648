"""The frames to one client connection, coalesced: what the connection's requests send in one
turn of the event loop leaves in one write.

The decode answers a step with every sequence's tokens at once (one STEP_TOKENS per link); the
prefill's read callback relays each request's TOKENS to its client (`send_nowait`, straight from
the callback while the client keeps up), or puts it in the request's inbox for its task to
`send`. Sent one by one, that was a `send` syscall per frame and, under the per-frame write
timeout it used, an `asyncio.Timeout` rescheduled per token: a large share of the prefill loop's
time at 256 requests in flight (issue 24). Here a frame is appended to the connection's pending
bytes, and one callback at the next loop turn writes them all (`FrameChannel.write_nowait`: one
syscall when the socket takes it, in order behind any write still pending otherwise).

Back-pressure is asyncio's StreamWriter's: `send` returns at once while the client keeps up,
and waits only while more than `high_water` bytes are queued for it. A client that leaves its
stream unread for `write_timeout_s` (bytes queued for it all that time, none of them taken) gets
TimeoutError from the next `send` of any of its requests. A sender that cannot wait asks
`can_send_now` first (False where `send` would wait or raise) and then `send_nowait`s, or leaves
the frame to a task's `send`: back-pressure and the timeout hold for every frame either way.
Every frame to the connection goes through one writer, so frames keep the order their senders
gave them."""

from __future__ import annotations

import asyncio

from common.protocol import Message, encode
from common.wire.channel import FrameChannel

HIGH_WATER = 256 * 1024  # bytes queued for a client before its senders wait for it


class ClientWriter:
    """Not thread-safe; the channel's event loop only."""

    def __init__(
        self, channel: FrameChannel, *, write_timeout_s: float, high_water: int = HIGH_WATER
    ) -> None:
        self.channel = channel
        self.write_timeout_s = write_timeout_s
        self.high_water = high_water
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self._handed = 0  # bytes given to the channel; minus its queue: what the client took
        self._taken = 0  # that, as last seen by send
        self._stalled_since = -1.0  # loop time since when it has taken nothing (-1: keeps up)
        self.writes = 0  # writes handed to the channel (each carries one or more frames)

    async def send(self, msg: Message) -> None:
        """Queue `msg` behind every frame queued before it; it leaves with the others at the end
        of this loop turn. ConnectionError once the connection is closed; TimeoutError when the
        client has not read its backlog within `write_timeout_s`."""
        if self.channel.closed:
            raise ConnectionError("client connection closed")
        self._queue(msg)
        deadline = self._stall_deadline()
        if deadline is None:  # the client keeps up (the common case: no clock read, no timer)
            return
        if self._loop.time() >= deadline:
            raise TimeoutError(f"the client read nothing for {self.write_timeout_s} s")
        if self.channel.queued > self.high_water:  # the client is behind: wait for it
            async with asyncio.timeout_at(deadline):
                await self.channel.drain()

    def can_send_now(self) -> bool:
        """True if a `send` now would neither wait nor fail: the connection is open and the
        client keeps up, or is behind by at most `high_water` bytes and has taken some of its
        backlog within `write_timeout_s`. Moves the stall clock as `send` does. A caller that
        cannot wait (a read callback) asks this, then `send_nowait`s, in the same loop turn; on
        False it leaves the frame to a task's `send`, which waits for the client or raises."""
        if self.channel.closed:
            return False
        deadline = self._stall_deadline()
        if deadline is None:
            return True
        return self.channel.queued <= self.high_water and self._loop.time() < deadline

    def send_nowait(self, msg: Message) -> None:
        """Queue `msg` as `send` does, without waiting for the client: only after
        `can_send_now()` said True in this loop turn (else the frame would go past the client's
        back-pressure and write timeout)."""
        self._queue(msg)

    def _queue(self, msg: Message) -> None:
        """`msg` behind the pending frames; the first of a turn schedules the flush."""
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(encode(msg))

    def _stall_deadline(self) -> float | None:
        """None while nothing is queued for the client (it keeps up); else when it times out:
        `write_timeout_s` after it last took any of its backlog, or fell behind."""
        queued = self.channel.queued
        taken = self._handed - queued
        if not queued:
            self._taken, self._stalled_since = taken, -1.0
            return None
        if taken > self._taken or self._stalled_since < 0:  # it read some, or just fell behind
            self._taken, self._stalled_since = taken, self._loop.time()
        return self._stalled_since + self.write_timeout_s

    def flush(self) -> None:
        """Hand every pending frame to the channel now, in one write (a no-op when none is)."""
        if not self._pending:
            return
        data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending.clear()
        self.writes += 1
        self._handed += len(data)
        self.channel.write_nowait(data)


__all__ = ["HIGH_WATER", "ClientWriter"]
