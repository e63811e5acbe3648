"""A prefill daemon as the decode daemon sees it: one link's channel, its KVConsumer, its frames.

Life: HELLO (fingerprint check) → REGISTER (`register`: the peer's pool opened once, through the
KVConsumer) → HANDOFF/ABORT/PING until the link ends. Frames to the peer leave in order through
the channel's write queue (`post`), a step's frames for one link in one write (`post_many`).
The server ends a link top-down: its sequences are dropped (DecodeRequests.drop_peer), pulls in
flight drained (`drain`), then `close` unmaps the peer's pool and closes the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from typing import Any

import structlog
import torch

from common.channel import FrameChannel
from common.errors import PdkvError
from common.kvpool import KVPool
from common.logs import clip
from common.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Hello,
    HelloOk,
    Message,
    Register,
    Registered,
    compat_diff,
    encode,
    make_error,
)
from common.transfer import KVConsumer, TransferRefused

log = structlog.get_logger(__name__)
_ids = itertools.count(1)


class HandshakeError(PdkvError):
    """HELLO or REGISTER refused; `code` is the ERROR to answer with."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Peer:
    def __init__(self, channel: FrameChannel) -> None:
        self.channel = channel
        self.link_id = f"link-{next(_ids)}"
        self.pid = 0
        self.name = ""
        self.consumer: KVConsumer | None = None  # from REGISTER on
        self.connected_at = time.monotonic()
        self.handoffs = 0
        self.greeted = False  # a HELLO was accepted: this connection is a link
        self._closed = False
        self.log = log.bind(link=self.link_id)

    # ---- handshake -------------------------------------------------------------------------------
    def check_hello(self, hello: Hello, fingerprint: str, compat: dict[str, Any]) -> HelloOk:
        """HELLO_OK, or INCOMPATIBLE naming both protocol versions or the fields that differ."""
        if hello.protocol_version != PROTOCOL_VERSION:
            raise HandshakeError(
                ErrorCode.INCOMPATIBLE,
                f"protocol version {hello.protocol_version} (prefill) ≠ {PROTOCOL_VERSION} "
                "(decode): run the same pdkv version on both daemons",
            )
        if hello.fingerprint != fingerprint:
            diff = compat_diff(compat, hello.compat) or "fields not sent"
            raise HandshakeError(
                ErrorCode.INCOMPATIBLE,
                f"the prefill's model or pool does not match this decode's: {diff} "
                f"(prefill ≠ decode; fingerprint {clip(hello.fingerprint, 64)} ≠ {fingerprint}): "
                "both daemons need the same model, dtype, block size and device kind",
            )
        self.pid, self.name = hello.pid, clip(hello.name, 64)
        self.greeted = True
        self.log = self.log.bind(peer_pid=hello.pid)
        return HelloOk(fingerprint=fingerprint, pid=os.getpid(), link_id=self.link_id)

    def register(
        self, reg: Register, local: KVPool, stream: torch.cuda.Stream | None
    ) -> Registered:
        """Open the peer's pool once for this link (HandshakeError if it cannot be)."""
        try:
            self.consumer = KVConsumer.open(reg, self.channel.take_fds, local, stream)
        except TransferRefused as exc:
            raise HandshakeError(exc.code, str(exc)) from exc
        assert self.consumer.peer is not None
        self.log.info(
            "peer_registered", backend=self.consumer.kind, num_blocks=self.consumer.peer.num_blocks
        )
        return Registered(num_blocks=local.num_blocks)

    # ---- output ----------------------------------------------------------------------------------
    def post(self, msg: Message) -> None:
        """Send a frame now (or right after the frames before it); frames leave in order."""
        if not self._closed:
            self.channel.write_nowait(encode(msg))

    def post_many(self, msgs: list[Message]) -> None:
        """Several frames in one write (a decode step's TOKENS/FINISH for this link)."""
        if msgs and not self._closed:
            self.channel.write_nowait(b"".join(encode(m) for m in msgs))

    def post_error(self, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        self.post(make_error(code, message, request_id))

    async def flush(self, timeout: float = 1.0) -> None:
        """Wait (bounded) until posted frames are written."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.channel.drain()

    # ---- teardown --------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    async def drain(self) -> None:
        """Wait until no pull reads the peer's pool."""
        if self.consumer is not None:
            await self.consumer.drain()

    def close(self) -> None:
        """Idempotent: unmap the peer's pool, close its events and the socket (after drain)."""
        if self._closed:
            return
        self._closed = True
        if self.consumer is not None:
            self.consumer.close()
        self.channel.close()
        if self.greeted:  # a STATUS probe's connection is no link: health checks log nothing
            self.log.info("peer_closed", handoffs=self.handoffs)


__all__ = ["HandshakeError", "Peer"]
