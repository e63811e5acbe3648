"""Hand-driven peers over real sockets: a fake prefill (link client) and a fake decode (link server).

Both speak the real protocol through common.wire.channel.FrameChannel with a real shared-memory pool, so the
daemon under test sees exactly what a real peer would send, until the test makes the fake misbehave.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from pathlib import Path

from common.ipc.shm import ShmRegion
from common.kv.pool import KVPool, PoolLayout
from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    ConnectionClosed,
    Error,
    ErrorCode,
    Finish,
    Handoff,
    Hello,
    HelloOk,
    KvReady,
    Message,
    Ping,
    Pong,
    Register,
    Registered,
    Release,
    Usage,
    fingerprint,
)
from common.wire.channel import FrameChannel, connect

BLOCK = 16


def tiny_layout(model, num_blocks: int = 16) -> PoolLayout:  # type: ignore[no-untyped-def]
    """The pool layout the daemons build for `model` on CPU (float32, block size 16)."""
    layers, kv_heads, head_dim = model.kv_layout_args()
    return PoolLayout(
        num_blocks=num_blocks,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=BLOCK,
        dtype="float32",
    )


class FakePrefill:
    """A link client that does HELLO/REGISTER by hand with a real memfd pool, then obeys the test."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        self.layout = tiny_layout(model)
        self.fingerprint = fingerprint(
            model_id=model.fingerprint, layout=self.layout.to_wire(), backend="shm"
        )
        self.pool = KVPool.create(self.layout)
        self.region = ShmRegion.export(self.pool.tensor)
        self.channel: FrameChannel | None = None

    async def link(self, path: str, timeout: float = 10.0) -> HelloOk:
        """Connect and complete HELLO and REGISTER; returns the decode's HELLO_OK."""
        self.channel = await connect(path)
        hello = Hello(
            protocol_version=PROTOCOL_VERSION,
            fingerprint=self.fingerprint,
            backend="shm",
            pid=os.getpid(),
            name="fake-prefill",
        )
        await self.channel.send(hello)
        ok = await asyncio.wait_for(self.channel.recv(), timeout)
        assert isinstance(ok, HelloOk), ok
        fds = self.region.fds()
        reg = Register.build(self.layout.to_wire(), [self.region.desc], [len(fds)], [])
        await self.channel.send(reg, fds)
        done = await asyncio.wait_for(self.channel.recv(), timeout)
        assert isinstance(done, Registered), done
        return ok

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.region.close()


class FakeDecode:
    """A link server on its own thread and loop. Mutable knobs decide how it behaves:

    `answer_pings` (PONG each PING), `release` (RELEASE each HANDOFF at once, an early one at its
    KV_READY, as the decode does once it has pulled), `accept` (serve new
    connections; when False they are closed at once), `finish_on_first` (answer the prefill's
    KV_READY, the first token after an early HANDOFF, with RELEASE and FINISH). It sends no TOKENS.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.answer_pings = True
        self.release = False
        self.accept = True
        self.deaf = False
        self.no_capacity = False  # answer every HANDOFF with ERROR NO_CAPACITY
        self.no_capacity_once: set[str] = set()  # answer these ids' first HANDOFF so
        # answer these ids' first HANDOFF so and then close its connection: the daemon reads the
        # refusal before it sees the link end, whatever its own timing
        self.refuse_then_drop: set[str] = set()
        self.finish_on_first = False
        self.frames: list[tuple[str, str]] = []  # (type, request id) of every request's frame
        self.first_tokens: list[KvReady] = []  # KV_READY from the prefill (early handoffs)
        self._refused: set[str] = set()  # answered NO_CAPACITY, no HANDOFF accepted since
        self._early: dict[str, int] = {}  # `release`: early HANDOFFs awaiting their KV_READY
        self.stalled = False  # after the handshake, read nothing more: the daemon's writes block
        self.handoff_links: list[str] = []  # the link (connection) each HANDOFF came on
        self.handoffs: list[Handoff] = []
        self.aborts: list[str] = []
        self.connections = 0
        self.channels: list[FrameChannel] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Task[None] | None = None
        self._listen: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> FakeDecode:
        self._listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listen.bind(str(self.path))
        self._listen.listen(16)
        self._listen.setblocking(False)
        self._thread.start()
        self.call(self._start_server())
        return self

    def call(self, coro, timeout: float = 10.0):  # type: ignore[no-untyped-def]
        """Run `coro` on the fake's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start_server(self) -> None:
        self._server = asyncio.create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        assert self._listen is not None
        while True:
            conn, _ = await self._loop.sock_accept(self._listen)
            if not self.accept:
                conn.close()
                continue
            self.connections += 1
            ch = FrameChannel(conn)
            self.channels.append(ch)
            task = asyncio.create_task(self._serve(ch, f"fake-{self.connections}"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, ch: FrameChannel, link_id: str) -> None:
        with contextlib.suppress(ConnectionClosed, OSError, asyncio.CancelledError):
            hello = await ch.recv()
            assert isinstance(hello, Hello)
            await ch.send(HelloOk(fingerprint=hello.fingerprint, pid=os.getpid(), link_id=link_id))
            reg = await ch.recv()
            assert isinstance(reg, Register)
            for fd in ch.take_fds(sum(r.num_fds for r in reg.regions)):
                os.close(fd)
            await ch.send(Registered(num_blocks=64))
            if self.stalled:  # a hung decode: its socket fills up, the peer's writes block
                self._loop.remove_reader(ch.sock.fileno())
                await asyncio.Event().wait()
            while True:
                await self._on_message(ch, await ch.recv(), link_id)
        if self.deaf:  # hold the socket open: the daemon must find out from its own writes
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
        ch.close()

    async def _on_message(self, ch: FrameChannel, msg: Message, link_id: str) -> None:
        if isinstance(msg, Ping) and self.answer_pings:
            await ch.send(Pong(seq=msg.seq, sent_ns=msg.sent_ns))
        elif isinstance(msg, Handoff):
            self.frames.append(("HANDOFF", msg.request_id))
            self.handoffs.append(msg)
            self.handoff_links.append(link_id)
            drop = msg.request_id in self.refuse_then_drop
            if self.no_capacity or msg.request_id in self.no_capacity_once or drop:
                self.no_capacity_once.discard(msg.request_id)
                self.refuse_then_drop.discard(msg.request_id)
                self._refused.add(msg.request_id)
                await ch.send(
                    Error(code=ErrorCode.NO_CAPACITY, message="fake", request_id=msg.request_id)
                )
                if drop:
                    ch.close()
            elif self.finish_on_first and msg.first_token is not None:
                self._refused.discard(msg.request_id)
                await self._finish(ch, msg.request_id)
            elif self.release and msg.first_token is not None:
                await ch.send(Release(request_id=msg.request_id, event_slot=msg.event_slot))
            elif self.release:  # early: released once its KV_READY says the KV is written
                self._early[msg.request_id] = msg.event_slot
        elif isinstance(msg, KvReady):
            self.frames.append(("KV_READY", msg.request_id))
            self.first_tokens.append(msg)
            slot = self._early.pop(msg.request_id, None)
            if msg.request_id in self._refused:
                pass  # a refused request's is dropped, as the decode does
            elif self.finish_on_first:
                await self._finish(ch, msg.request_id)
            elif slot is not None:
                await ch.send(Release(request_id=msg.request_id, event_slot=slot))
        elif isinstance(msg, Abort):
            self.frames.append(("ABORT", msg.request_id))
            self.aborts.append(msg.request_id)

    @staticmethod
    async def _finish(ch: FrameChannel, request_id: str) -> None:
        """RELEASE and FINISH: the request is done once its first token is known."""
        await ch.send(Release(request_id=request_id))
        usage = Usage(prompt_tokens=1, completion_tokens=1)
        await ch.send(Finish(request_id=request_id, reason="length", usage=usage))

    def deafen(self) -> None:
        """Stop reading on every open connection (SHUT_RD) but keep it open: the daemon's writes
        now fail with EPIPE while its reads see nothing wrong, as when a peer has just died and
        its end of file is not yet seen."""

        async def run() -> None:
            self.deaf = True
            for ch in self.channels:
                if not ch.closed:
                    ch.sock.shutdown(socket.SHUT_RD)

        self.call(run())

    def drop_all(self) -> None:
        """Close every open connection (the daemon sees its link end; it may reconnect)."""

        async def run() -> None:
            for ch in self.channels:
                ch.close()

        self.call(run())

    def send_all(self, msg: Message) -> None:
        """Send `msg` on every open connection (e.g. a late RELEASE)."""

        async def run() -> None:
            for ch in self.channels:
                if not ch.closed:
                    with contextlib.suppress(OSError):
                        await ch.send(msg)

        self.call(run())

    def stop(self) -> None:
        async def shut() -> None:
            if self._server is not None:
                self._server.cancel()
            for task in list(self._tasks):
                task.cancel()
            for ch in self.channels:
                ch.close()

        with contextlib.suppress(Exception):
            self.call(shut())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
        if self._listen is not None:
            self._listen.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
