"""The prefill daemon's link to its decode daemon: connect with backoff, handshake, route answers.

Once per connection: HELLO (fingerprint) and REGISTER (the KVProducer's payload: the pool's
descriptor, its fd for shm, the event ring's handles for CUDA; exported once per process).
While connected, PINGs go out every heartbeat interval and any silence longer than the heartbeat
timeout ends the link. The frames about requests go to the listener given to `start` (the
request pipeline, `LinkListener`); on loss it is told `link_lost` (every request handed to this
link gets LINK_LOST) and the link reconnects with capped exponential backoff.

With `--decode tcp://HOST:PORT` the link crosses hosts (common.tcplink): HELLO carries our
nonce, the decode's HELLO_OK its nonce and key proof (checked here: a wrong one is answered with
ERROR AUTH_FAILED and refused), REGISTER our proof and the pool's NIXL region. The producer is
then a NixlProducer (`make_producer`), and on a push link PUSH frames start its WRITEs.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Protocol

import msgspec
import structlog

from common.channel import FrameChannel, connect
from common.config import PrefillConfig
from common.errors import PdkvError, ProtocolError
from common.modelrt import ModelRuntime
from common.protocol import (
    PROTOCOL_VERSION,
    ConnectionClosed,
    Error,
    ErrorCode,
    Hello,
    HelloOk,
    Message,
    Ping,
    Pong,
    Push,
    Registered,
    encode,
    make_error,
)
from common.tcplink import TcpSettings, connect_tcp, new_nonce, proof, proof_ok, tcp_settings
from common.transfer import KVProducer
from common.transfer.nixl_sides import NixlProducer

log = structlog.get_logger(__name__)


class LinkRefused(PdkvError):
    """The decode daemon refused our HELLO or REGISTER (e.g. INCOMPATIBLE)."""


def check_decode_option(cfg: PrefillConfig) -> TcpSettings | None:
    """--decode's address, key and NIXL, checked (PdkvError saying what to do); None without."""
    if cfg.decode is None:
        return None
    return tcp_settings(cfg.decode, cfg.link_key_file, "--decode")


def make_producer(cfg: PrefillConfig, rt: ModelRuntime) -> KVProducer:
    """The IPC producer for the local socket, a NixlProducer for a link across hosts."""
    if cfg.decode is None:
        return KVProducer(rt.pool, rt.allocator, rt.backend, event_slots=cfg.event_slots)
    return NixlProducer(
        rt.pool, rt.allocator, transfer=cfg.transfer, loop=asyncio.get_running_loop()
    )


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
        *,
        fingerprint: str,
        compat: dict,
        backend: str,
        producer: KVProducer,
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
        self.tcp = check_decode_option(cfg)

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

    async def wait_up(self, timeout: float) -> None:
        """Return once the link is up, else ConnectionError naming the last error: after
        `timeout` if the link was up before and dropped (a decode restart: worth waiting for),
        but as soon as the next connection attempt fails (at most the 2 s backoff away) if it
        never came up or the decode refused it (INCOMPATIBLE): a prefill started without its
        decode, or a mismatched pair, answers in seconds instead of after the whole timeout."""
        if self.ready.is_set():
            return
        transient = self.connects > 0 and not self.refused
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
                return await connect(str(self.cfg.link_path))
            sock = await connect_tcp(self.tcp.host, self.tcp.port, timeout)
            return FrameChannel(sock, max_fds=0)

    async def _connect_once(self) -> None:
        timeout = self.cfg.heartbeat_timeout_s
        channel = self.channel = await self._open(timeout)
        nonce = new_nonce() if self.tcp is not None else ""
        await channel.send(
            Hello(
                protocol_version=PROTOCOL_VERSION,
                fingerprint=self.fingerprint,
                backend=self.backend,
                pid=os.getpid(),
                name="prefill",
                compat=self.compat,
                nonce=nonce,
            )
        )
        async with asyncio.timeout(timeout):
            ok = await channel.recv()
        if isinstance(ok, Error):
            if ok.code == ErrorCode.AUTH_FAILED:
                log.error("link_auth_failed", error=ok.message, by="decode")
            raise LinkRefused(f"decode refused the link ({ok.code}): {ok.message}")
        if not isinstance(ok, HelloOk):
            raise ProtocolError(f"expected HELLO_OK, got {ok.TYPE.name}")
        reg, fds = self.producer.register()
        if self.tcp is not None:
            await self._check_decode_proof(channel, nonce, ok)
            reg = msgspec.structs.replace(
                reg, proof=proof(self.tcp.key, "prefill", nonce, ok.nonce)
            )
        await channel.send(reg, fds)
        async with asyncio.timeout(timeout):
            done = await channel.recv()
        if isinstance(done, Error):
            raise LinkRefused(f"decode refused REGISTER ({done.code}): {done.message}")
        if not isinstance(done, Registered):
            raise ProtocolError(f"expected REGISTERED, got {done.TYPE.name}")
        if isinstance(self.producer, NixlProducer):
            try:
                self.producer.connected(done)
            except PdkvError as exc:
                raise LinkRefused(str(exc)) from exc
        self.link_id = ok.link_id
        self.connects += 1
        self.refused = False
        self.ready.set()
        log.info("decode_link_up", link=self.link_id, decode_pid=ok.pid, connects=self.connects)

    async def _check_decode_proof(self, channel: FrameChannel, nonce: str, ok: HelloOk) -> None:
        """The decode must prove the key before it learns anything of our pool; if it cannot,
        tell it (ERROR AUTH_FAILED, so its log says why too) and refuse the link."""
        assert self.tcp is not None
        if proof_ok(self.tcp.key, "decode", nonce, ok.nonce, ok.proof):
            return
        why = "the decode's key proof is wrong: the two daemons' --link-key-file differ"
        log.error("link_auth_failed", error=why, by="prefill")
        await channel.send(make_error(ErrorCode.AUTH_FAILED, why))
        raise LinkRefused(why)

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
        elif isinstance(msg, Error) and msg.request_id is None:
            raise LinkRefused(f"decode reported {msg.code}: {msg.message}")
        elif isinstance(msg, Push) and isinstance(self.producer, NixlProducer):
            self.producer.push(msg, self._post)
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


__all__ = ["DecodeLink", "LinkListener", "LinkRefused"]
