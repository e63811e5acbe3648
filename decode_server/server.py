"""The decode daemon: accepts links, imports each peer's pool once, and hands their frames to
DecodeRequests (requests.py), which pulls KV and decodes in batches; lifecycle, status.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import structlog

from common import daemon
from common.config import DecodeConfig
from common.errors import PdkvError, ProtocolError
from common.channel import FrameChannel
from common.modelrt import ModelRuntime
from common.protocol import (
    Abort,
    ConnectionClosed,
    Error,
    ErrorCode,
    Handoff,
    Hello,
    Ping,
    Pong,
    Register,
    Status,
    StatusReply,
)
from common.rundir import check_free, remove_file, write_pidfile
from decode_server.peer import HandshakeError, Peer
from decode_server.requests import DecodeRequests

log = structlog.get_logger(__name__)


class DecodeServer:
    def __init__(self, cfg: DecodeConfig, rt: ModelRuntime) -> None:
        self.cfg = cfg
        self._spin_s = cfg.spin_us / 1e6
        self.rt = rt
        self.requests = DecodeRequests(rt, max_batch=cfg.max_batch)
        self.peers: dict[str, Peer] = {}
        self.started = time.monotonic()
        self._listen: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._listen = daemon.bind_unix_socket(self.cfg.link_path, group=self.cfg.socket_group)
        write_pidfile(self.cfg.pidfile)
        self.requests.engine.start()
        accept = daemon.accept_loop(
            self._listen, self.cfg.uids(), self._serve_conn, self._tasks, name="link"
        )
        self._tasks.add(asyncio.create_task(accept, name="decode-accept"))
        log.info("decode_ready", socket=str(self.cfg.link_path), pid=os.getpid())

    async def shutdown(self) -> None:
        """Stop accepting, drain sequences under the timeout, answer the rest, close everything."""
        log.info("decode_draining", sequences=len(self.requests))
        if self._listen is not None:
            self._listen.close()
            remove_file(self.cfg.link_path)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while len(self.requests) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for seq in self.requests.engine.sequences():
            self.requests.drop(seq, ErrorCode.SHUTTING_DOWN, "decode daemon is shutting down")
        for peer in list(self.peers.values()):
            await peer.flush()
            peer.close()
        await self.requests.engine.stop()
        for task in self._tasks:
            task.cancel()
        self.rt.close()
        remove_file(self.cfg.pidfile)
        log.info("decode_stopped")

    # ---- connections ---------------------------------------------------------------------------
    async def _serve_conn(self, conn: socket.socket) -> None:
        channel = FrameChannel(conn)
        peer = Peer(channel, on_close=self._peer_closed)
        peer.vocab_size = self.rt.model.config.vocab_size
        timeout = self.cfg.heartbeat_timeout_s
        try:
            async with asyncio.timeout(timeout):
                first = await channel.recv()
            if isinstance(first, Status):
                peer.post(self.status())
                await peer.flush()
                return
            if not isinstance(first, Hello):
                raise ProtocolError(f"expected HELLO first, got {first.TYPE.name}")
            peer.post(peer.check_hello(first, self.rt.fingerprint, self.rt.backend))
            async with asyncio.timeout(timeout):
                reg = await channel.recv()
            if not isinstance(reg, Register):
                raise ProtocolError(f"expected REGISTER after HELLO, got {reg.TYPE.name}")
            peer.post(peer.import_pool(reg, self.rt.layout, self.rt.device))
            self.peers[peer.link_id] = peer
            watchdog = asyncio.create_task(channel.watch_idle(timeout))
            try:
                await channel.dispatch(lambda msg: self._dispatch(peer, msg))
            finally:
                watchdog.cancel()
        except HandshakeError as exc:
            peer.log.warning("handshake_refused", code=exc.code, error=str(exc))
            peer.post_error(exc.code, str(exc))
            await peer.flush()
        except ProtocolError as exc:
            peer.log.warning("protocol_error", error=str(exc))
            peer.post_error(ErrorCode.PROTOCOL_ERROR, str(exc))
            await peer.flush()
        except TimeoutError:
            peer.log.warning("link_heartbeat_missed", timeout_s=timeout)
        except (ConnectionClosed, OSError) as exc:
            peer.log.info("link_closed", reason=str(exc) or type(exc).__name__)
        except PdkvError as exc:  # nothing may escape the connection's task
            peer.log.warning("link_failed", error=str(exc))
            peer.post_error(ErrorCode.PROTOCOL_ERROR, str(exc))
            await peer.flush()
        except Exception as exc:  # a bug: end this link only, loudly
            peer.log.exception("link_failed_internal")
            peer.post_error(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            await peer.flush()
        finally:
            if peer.pulls:  # never unmap the peer's pool under a copy that still reads it
                await asyncio.gather(*peer.pulls, return_exceptions=True)
            peer.close()

    def _dispatch(self, peer: Peer, msg) -> None:  # type: ignore[no-untyped-def]
        if isinstance(msg, Handoff):
            self.requests.handoff(peer, msg)
            peer.channel.spin(self._spin_s)  # handoffs come in bursts: the next may be close
        elif isinstance(msg, Ping):
            peer.post(Pong(seq=msg.seq, sent_ns=msg.sent_ns))
        elif isinstance(msg, Abort):
            self.requests.abort(peer, msg.request_id)
        elif isinstance(msg, Status):
            peer.post(self.status())
        elif isinstance(msg, Error):
            peer.log.warning(
                "peer_reported_error", code=msg.code, error=msg.message, request_id=msg.request_id
            )
        else:
            raise ProtocolError(f"unexpected {msg.TYPE.name} on an established link")

    def _peer_closed(self, peer: Peer) -> None:
        """Link lost: drop its sequences and free their blocks (mappings close in Peer.close)."""
        self.peers.pop(peer.link_id, None)
        dropped = self.requests.drop_peer(peer)
        if dropped:
            log.warning("link_lost_sequences_dropped", link=peer.link_id, dropped=dropped)

    def status(self) -> StatusReply:
        now = time.monotonic()
        return StatusReply(
            role="decode",
            pid=os.getpid(),
            uptime_s=round(now - self.started, 3),
            pool=self.rt.pool_stats(),
            inflight=len(self.requests),
            links=[
                {
                    "link": p.link_id,
                    "peer_pid": p.pid,
                    "age_s": round(now - p.connected_at, 1),
                    "handoffs": p.handoffs,
                }
                for p in self.peers.values()
            ],
            device=str(self.rt.device),
            backend=self.rt.backend,
        )


async def serve(cfg: DecodeConfig) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, exit code."""
    check_free(cfg.link_path, cfg.pidfile)  # fail fast, before loading the model
    return await daemon.serve_until_stopped(
        lambda: ModelRuntime.load(cfg, "decode"),
        lambda rt: DecodeServer(cfg, rt),
        ModelRuntime.close,
    )
