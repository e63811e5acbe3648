"""One link from a prefill daemon, seen from the decode daemon.

Lifecycle: HELLO (fingerprint check) → REGISTER (import the peer's pool once) → HANDOFF/ABORT/PING
until the link ends; then every sequence of this peer is dropped, its blocks freed and the peer's
mappings closed. Outgoing frames go through one writer task so they leave in order and coalesce.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Callable

import structlog

from common.errors import PdkvError, ProtocolError
from common.ipc.backends import backend_for
from common.ipc.base import SharedRegion
from common.kvpool import KVPool, PoolLayout
from common.channel import FrameChannel
from common.protocol import (
    ErrorCode,
    Handoff,
    Hello,
    HelloOk,
    Message,
    Register,
    Registered,
    encode,
    make_error,
)

log = structlog.get_logger(__name__)
_ids = itertools.count(1)


class HandshakeError(PdkvError):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Peer:
    """A prefill daemon's link: its channel, imported pool and outgoing queue."""

    def __init__(self, channel: FrameChannel, *, on_close: Callable[[Peer], None]) -> None:
        self.channel = channel
        self.link_id = f"link-{next(_ids)}"
        self.pid = 0
        self.name = ""
        self.pool: KVPool | None = None
        self.regions: list[SharedRegion] = []
        self.events = None  # ImportedEventRing on CUDA, None on CPU
        self.connected_at = time.monotonic()
        self.handoffs = 0
        self.pulls: set[asyncio.Task[None]] = set()  # in-flight CUDA pulls from this peer's pool
        self._on_close = on_close
        self._closed = False
        self.log = log.bind(link=self.link_id)

    # ---- handshake -----------------------------------------------------------------------------
    def check_hello(self, hello: Hello, fingerprint: str, backend: str) -> HelloOk:
        if hello.fingerprint != fingerprint:
            raise HandshakeError(
                ErrorCode.INCOMPATIBLE,
                f"fingerprint {hello.fingerprint} (backend {hello.backend}) does not match ours "
                f"{fingerprint} (backend {backend}): both daemons need the same model, dtype, "
                "block size and device kind",
            )
        self.pid, self.name = hello.pid, hello.name
        self.log = self.log.bind(peer_pid=hello.pid)
        return HelloOk(fingerprint=fingerprint, pid=os.getpid(), link_id=self.link_id)

    def import_pool(self, reg: Register, local: PoolLayout, device) -> Registered:  # type: ignore[no-untyped-def]
        """Open the peer's regions once; the first region is its KV pool."""
        try:
            layout = PoolLayout.from_wire(reg.layout)
            descs = reg.descriptors()
        except (PdkvError, ValueError) as exc:
            raise HandshakeError(ErrorCode.BAD_REQUEST, f"bad REGISTER: {exc}") from exc
        if layout.compat_fields() != local.compat_fields():
            raise HandshakeError(
                ErrorCode.INCOMPATIBLE,
                f"peer pool layout {layout.compat_fields()} differs from ours {local.compat_fields()}",
            )
        if len(descs) != 1:
            raise HandshakeError(ErrorCode.BAD_REQUEST, f"expected 1 pool region, got {len(descs)}")
        fds = self.channel.take_fds(sum(r.num_fds for r in reg.regions))
        try:
            backend = backend_for(descs[0].kind)
        except PdkvError as exc:
            _close_fds(fds)
            raise HandshakeError(ErrorCode.INCOMPATIBLE, str(exc)) from exc
        try:
            region = backend.open_for(descs[0], fds, device)  # owns the fds from here on
            self.regions.append(region)
            self.pool = KVPool(layout, region.to_tensor())
        except PdkvError as exc:
            raise HandshakeError(
                ErrorCode.BAD_REQUEST, f"cannot open the peer's pool: {exc}"
            ) from exc
        if reg.event_count:
            from common.ipc.events import ImportedEventRing

            self.events = ImportedEventRing.open(reg.event_handle_list(), device)
        self.log.info("peer_registered", backend=descs[0].kind, num_blocks=layout.num_blocks)
        return Registered(num_blocks=local.num_blocks)

    vocab_size = 2**31  # set by the server to its model's vocabulary

    def validate_handoff(self, h: Handoff, block_size: int) -> None:
        """ProtocolError-free checks of one HANDOFF; raises ValueError with the reason."""
        if self.pool is None:
            raise ValueError("HANDOFF before REGISTER")
        h.sampling.validate()
        if h.num_tokens != len(h.prompt_tokens) or h.num_tokens == 0:
            raise ValueError(f"num_tokens {h.num_tokens} != {len(h.prompt_tokens)} prompt tokens")
        need = -(-h.num_tokens // block_size)
        if len(h.block_ids) != need:
            raise ValueError(
                f"{h.num_tokens} tokens need {need} blocks, HANDOFF names {len(h.block_ids)}"
            )
        vocab = self.vocab_size
        if max(h.prompt_tokens) >= vocab or h.first_token >= vocab:
            raise ValueError(f"token ids must be < vocab size {vocab}")
        if len(set(h.block_ids)) != len(h.block_ids):
            raise ValueError("HANDOFF block ids repeat")
        if max(h.block_ids) >= self.pool.num_blocks:
            raise ValueError(
                f"block id {max(h.block_ids)} outside the peer pool ({self.pool.num_blocks})"
            )
        if h.event_slot >= 0 and (self.events is None or h.event_slot >= len(self.events)):
            raise ValueError(f"event slot {h.event_slot} does not exist on this link")

    # ---- output --------------------------------------------------------------------------------
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

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Idempotent: stop the writer, drop the pool view, close mappings and the socket."""
        if self._closed:
            return
        self._closed = True
        self._on_close(self)
        self.pool = None
        if self.events is not None:
            self.events.close()
            self.events = None
        for region in self.regions:
            region.close()
        self.regions.clear()
        self.channel.close()
        self.log.info("peer_closed", handoffs=self.handoffs)


__all__ = ["HandshakeError", "Peer", "ProtocolError"]


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
