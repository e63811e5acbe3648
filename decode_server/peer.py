"""A prefill daemon as the decode daemon sees it: one link's channel, its Consumer, its frames.

Life: HELLO (key proofs on a TCP link, then the fingerprint check) → REGISTER (`register`: the
peer's pool opened once, by the link kind's ConsumerSide) → HANDOFF/ABORT/PING until the link
ends. Frames to the peer leave in order through
the channel's write queue (`post`), a step's frames for one link in one write (`post_many`).
The server ends a link top-down: pulls in flight drained (`drain`), its sequences dropped
(DecodeRequests.drop_peer), then `close` unmaps the peer's pool and closes the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from typing import Any

import msgspec
import structlog

from common.daemon.logs import clip
from common.daemon.sched import cpus_apart
from common.errors import PdkvError
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
from common.transfer import Consumer, TransferRefused
from common.transfer.registry import UNIX, ConsumerSide
from common.wire.channel import FrameChannel
from common.wire.tcplink import new_nonce, proof, proof_ok

log = structlog.get_logger(__name__)
_ids = itertools.count(1)


class HandshakeError(PdkvError):
    """HELLO or REGISTER refused; `code` is the ERROR to answer with."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Peer:
    def __init__(
        self, channel: FrameChannel, kind: str, key: bytes | None = None, *, same_host: bool = True
    ) -> None:
        """`kind`: the link kind (common.transfer.registry); `key`: the shared secret of a TCP
        link (None on the Unix socket); `same_host`: the peer's clock is ours."""
        self.channel = channel
        self.kind = kind
        self.key = key
        self.same_host = same_host
        self._nonces = ("", "")  # (prefill's, ours) on a TCP link
        self.link_id = f"link-{next(_ids)}"
        self.pid = 0
        self.name = ""
        self.consumer: Consumer | None = None  # from REGISTER on
        self.connected_at = time.monotonic()
        self.handoffs = 0
        self.greeted = False  # a HELLO was accepted: this connection is a link
        # the prefill may run on none of our CPUs (common.daemon.sched.cpus_apart; REGISTER on): this
        # loop may poll for its KV_READY while it computes (server.py, AWAIT_KV_SPIN_S)
        self.cpus_apart = False
        self._closed = False
        self.log = log.bind(link=self.link_id)

    # ---- handshake -------------------------------------------------------------------------------
    def check_hello(self, hello: Hello, fingerprint: str, compat: dict[str, Any]) -> HelloOk:
        """HELLO_OK, or INCOMPATIBLE naming both protocol versions or the fields that differ; on
        a TCP link AUTH_FAILED first if the prefill brings no nonce (it has no key)."""
        if self.key is not None and not hello.nonce:
            raise HandshakeError(
                ErrorCode.AUTH_FAILED,
                "this decode's TCP link needs the shared key: start the prefill with "
                "--link-key-file (the same secret as the decode's)",
            )
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
        ok = HelloOk(fingerprint=fingerprint, pid=os.getpid(), link_id=self.link_id)
        if self.key is None:
            return ok
        ours = new_nonce()
        self._nonces = (hello.nonce, ours)
        return msgspec.structs.replace(
            ok, nonce=ours, proof=proof(self.key, "decode", hello.nonce, ours)
        )

    def register(self, reg: Register, side: ConsumerSide) -> Registered:
        """Open the peer's pool once for this link through `side` (its kind's, this daemon's)
        and answer REGISTERED; HandshakeError if it cannot be. On a TCP link the prefill's key
        proof is checked first: nothing of our pool is touched for a peer without the key."""
        if self.key is not None and not proof_ok(self.key, "prefill", *self._nonces, reg.proof):
            raise HandshakeError(
                ErrorCode.AUTH_FAILED,
                "the prefill's key proof is wrong: the two daemons' --link-key-file differ",
            )
        try:
            self.consumer = side.open(reg, self.channel.take_fds, self.post)
        except TransferRefused as exc:
            raise HandshakeError(exc.code, str(exc)) from exc
        if self.kind == UNIX:  # the process at the socket's other end, as our kernel names it
            self.cpus_apart = cpus_apart(self.channel.peer_credentials()[0])
        self.log.info(
            "peer_registered",
            backend=self.consumer.kind,
            num_blocks=self.consumer.peer_blocks,
            cpus_apart=self.cpus_apart,
        )
        return self.consumer.registered()

    # ---- output ----------------------------------------------------------------------------------
    def post(self, msg: Message) -> None:
        """Send a frame now (or right after the frames before it); frames leave in order."""
        if not self._closed:
            self.channel.write_nowait(encode(msg))

    def post_many(self, msgs: list[Message]) -> None:
        """Several frames in one write (a decode step's frames for this link)."""
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
