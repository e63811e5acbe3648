"""The prefill daemon's link to its decode daemon: connect with backoff, handshake, route answers.

Once per connection the handshake (prefill_server/handshake.py: HELLO with the fingerprint,
REGISTER with the producer's payload). While connected, PINGs go out every heartbeat interval and any silence longer than the heartbeat
timeout ends the link. The frames about requests go to the listener given to `start` (the
request pipeline, `LinkListener`); on loss it is told `link_lost` (every request handed to this
link gets LINK_LOST) and the link reconnects with capped exponential backoff.

With `--decode tcp://HOST:PORT` the link crosses hosts (common.wire.tcplink; the handshake proves
the shared key both ways). The producer is the link kind's transport's (common.transfer.registry);
the link never names one: frames of the transport's own (NIXL's PUSH) go to
`producer.handle_frame`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import dataclass
from typing import Protocol

import structlog

from common.errors import PdkvError, ProtocolError
from common.protocol import (
    PROTOCOL_VERSION,
    ConnectionClosed,
    Error,
    Hello,
    Message,
    Ping,
    Pong,
    encode,
)
from common.transfer import Producer
from common.wire.channel import FrameChannel, connect
from common.wire.tcplink import connect_tcp
from prefill_server.config import PrefillConfig
from prefill_server.handshake import LinkRefused, check_decode_option, handshake

log = structlog.get_logger(__name__)


@dataclass
class DecodeLoad:
    """One decode's load as this prefill sees it (module docstring)."""

    mine: int = 0  # requests this prefill handed to it that have not ended
    sequences: int = 0  # the decode's sequences in flight at its last PONG
    free_blocks: int = -1  # its free blocks at its last PONG (-1: none reported yet)
    mine_at_report: int = 0  # `mine` when that PONG came

    def reported(self, pong: Pong) -> None:
        if pong.free_blocks >= 0:
            self.free_blocks = pong.free_blocks
            self.sequences = pong.sequences
            self.mine_at_report = self.mine

    @property
    def others(self) -> int:
        """The decode's sequences from other prefills, as of its last PONG."""
        return max(0, self.sequences - self.mine_at_report)

    @property
    def total(self) -> int:
        return self.mine + self.others


class LinkListener(Protocol):
    """What the link tells its receiver (the request pipeline), given to `DecodeLink.start`."""

    def deliver(self, msg: Message) -> None:
        """Each frame from the decode about a request, in the socket's read callback."""

    def link_lost(self, link_id: str, reason: str) -> None:
        """Once per established connection that ended, before the link reconnects."""


class DecodeLink:
    def __init__(
        self,
        cfg: PrefillConfig,
        address: str | None = None,
        *,
        fingerprint: str,
        compat: dict,
        backend: str,
        producer: Producer,
    ) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.compat = compat
        self.backend = backend
        self.producer = producer
        self.listener: LinkListener | None = None  # set by start(), before any connection
        self.channel: FrameChannel | None = None
        self.link_id = ""
        self.ready = asyncio.Event()
        self._attempted = asyncio.Event()  # set (and replaced) after each connection attempt
        self.refused = False  # the last attempt was refused by the decode (e.g. INCOMPATIBLE)
        self.connects = 0
        self.last_error = ""
        self.rtt_us = 0.0
        self._ping = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.address = address or cfg.decode_addresses[0]  # a socket path or tcp://HOST:PORT
        self.tcp = check_decode_option(cfg).get(self.address)
        self.load = DecodeLoad()  # what the decode last reported (PONG) and what we sent since

    @property
    def state(self) -> str:
        return "up" if self.ready.is_set() else "down"

    def start(self, listener: LinkListener) -> None:
        """Connect (and reconnect) from now on, telling `listener` the decode's frames and each
        loss of the connection."""
        self.listener = listener
        self._task = asyncio.create_task(self._run(), name="decode-link")

    async def stop(self) -> None:
        """End the link for good. The flag, not only the cancel, ends the reconnect loop: on
        Python 3.11 a cancel that lands as an inner await completes can be lost."""
        self._stopping = True
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._drop("prefill daemon is shutting down")

    async def wait_up(self, timeout: float, *, patient: bool = True) -> None:
        """Return once the link is up, else ConnectionError naming the last error: after
        `timeout` if the link was up before and dropped (a decode restart: worth waiting for,
        unless not `patient`: a prefill with other decodes), but as soon as the next connection
        attempt fails (at most the 2 s backoff away) if it never came up or the decode refused
        it (INCOMPATIBLE): a prefill started without its decode, or a mismatched pair, answers
        in seconds instead of after the whole timeout."""
        if self.ready.is_set():
            return
        transient = patient and self.connects > 0 and not self.refused
        awaited = self.ready if transient else self._attempted
        try:
            async with asyncio.timeout(max(timeout, 0)):
                await awaited.wait()
        except TimeoutError:
            pass
        if not self.ready.is_set():
            raise ConnectionError(
                f"no link to the decode daemon ({self.last_error or 'not connected yet'}; "
                "`pdkv status` shows the link)"
            )

    def _attempt_done(self) -> None:
        self._attempted.set()
        self._attempted = asyncio.Event()

    async def send(self, msg: Message, *, spin: bool = False) -> None:
        """Send on the live link; ConnectionError if there is none or the write fails. `spin`:
        an answer is due soon (RELEASE after HANDOFF), poll for it without sleeping a while.

        A failed write (the decode died and the reader has not seen EOF yet) fails the channel,
        so the link is dropped and its requests answered at once instead of at the heartbeat.
        """
        channel = self.channel
        if channel is None or not self.ready.is_set():
            raise ConnectionError("no link to the decode daemon")
        try:
            await channel.send(msg)
        except OSError as exc:
            channel.fail(ConnectionError(f"write to the decode daemon failed: {exc}"))
            raise ConnectionError(f"link to the decode daemon broke: {exc}") from exc
        if spin:
            channel.spin(self.cfg.spin_us / 1e6)

    async def _run(self) -> None:
        backoff = 0.05
        while not self._stopping:
            try:
                try:
                    await self._connect_once()
                finally:
                    self._attempt_done()
                backoff = 0.05
                await self._serve()
            except (OSError, ConnectionClosed, ProtocolError, LinkRefused, TimeoutError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.refused = isinstance(exc, LinkRefused)
                level = "warning" if self.connects else "info"
                if not self._stopping:
                    getattr(log, level)("decode_link_down", error=self.last_error, retry_s=backoff)
            except Exception as exc:  # a bug in a frame's handling: reconnect, never go deaf
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.refused = False
                log.exception("decode_link_failed_internal", retry_s=backoff)
            self._drop(self.last_error or "link closed")
            if self._stopping:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _open(self, timeout: float) -> FrameChannel:
        async with asyncio.timeout(timeout):
            if self.tcp is None:
                return await connect(self.address)
            sock = await connect_tcp(self.tcp.host, self.tcp.port, timeout)
            return FrameChannel(sock, max_fds=0)

    async def _connect_once(self) -> None:
        timeout = self.cfg.heartbeat_timeout_s
        channel = self.channel = await self._open(timeout)
        hello = Hello(
            protocol_version=PROTOCOL_VERSION,
            fingerprint=self.fingerprint,
            backend=self.backend,
            pid=os.getpid(),
            name="prefill",
            compat=self.compat,
        )
        ok, registered = await handshake(channel, hello, self.producer, self.tcp, timeout)
        # the decode's id for the connection, made unique among this prefill's decodes: leases
        # and requests are held by it
        link_id = f"{ok.link_id}@{self.address}"
        try:
            self.producer.connected(registered, link_id)
        except PdkvError as exc:
            raise LinkRefused(str(exc)) from exc
        self.link_id = link_id
        self.connects += 1
        self.refused = False
        self.ready.set()
        log.info("decode_link_up", link=self.link_id, decode_pid=ok.pid, connects=self.connects)

    async def _serve(self) -> None:
        assert self.channel is not None
        beat = asyncio.create_task(self._heartbeat(self.channel))
        watchdog = asyncio.create_task(self.channel.watch_idle(self.cfg.heartbeat_timeout_s))
        try:
            await self.channel.dispatch(self._on_frame)
        finally:
            beat.cancel()
            watchdog.cancel()

    def _on_frame(self, msg: Message) -> None:
        """Each frame from the decode, in the socket's read callback."""
        if isinstance(msg, Pong):
            self.rtt_us = (time.monotonic_ns() - msg.sent_ns) / 1000
            self.load.reported(msg)
        elif isinstance(msg, Error) and msg.request_id is None:
            raise LinkRefused(f"decode reported {msg.code}: {msg.message}")
        elif msg.TYPE in self.producer.caps.frames:
            self.producer.handle_frame(msg, self._post, self.link_id)
        elif self.listener is not None:
            self.listener.deliver(msg)

    async def _heartbeat(self, channel: FrameChannel) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
            try:
                await channel.send(Ping(seq=next(self._ping), sent_ns=time.monotonic_ns()))
            except OSError as exc:
                channel.fail(ConnectionError(f"heartbeat write failed: {exc}"))
                return

    def post(self, msg: Message) -> None:
        """A frame to the decode now, without awaiting (in order after what is being written);
        dropped if the link is gone."""
        if self.channel is not None and self.ready.is_set():
            self.channel.write_nowait(encode(msg))

    def _post(self, msg: Message) -> None:
        """A frame to the decode from a callback (PUSH_FAILED); dropped if the link is gone."""
        if self.channel is not None:
            self.channel.write_nowait(encode(msg))

    def _drop(self, reason: str) -> None:
        was_up = self.ready.is_set()
        self.ready.clear()
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if was_up and self.listener is not None:
            self.listener.link_lost(self.link_id, reason)


__all__ = ["DecodeLink", "DecodeLoad", "LinkListener"]
