"""The decode daemon: accepts links, imports each peer's pool once, pulls KV, decodes in batches.

Per HANDOFF: validate, reserve this request's blocks for its whole life (or answer NO_CAPACITY),
pull the prompt's blocks from the peer's pool into ours, send RELEASE, and add the sequence to the
continuous-batching loop. TOKENS leave after every step, FINISH when a sequence ends.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import structlog

from common import daemon
from common.config import DecodeConfig
from common.errors import OutOfBlocks, PdkvError, ProtocolError
from common.link import FrameChannel
from common.modelrt import ModelRuntime
from common.protocol import (
    Abort,
    ConnectionClosed,
    Error,
    ErrorCode,
    Finish,
    Handoff,
    Hello,
    Message,
    Ping,
    Pong,
    Register,
    Release,
    Status,
    StatusReply,
    Tokens,
    Usage,
)
from common.runtime import check_free, remove_file, write_pidfile
from decode_server.engine import DecodeEngine
from decode_server.peer import HandshakeError, Peer
from decode_server.puller import Puller
from decode_server.sequence import Sequence, blocks_needed

log = structlog.get_logger(__name__)


class DecodeServer:
    def __init__(self, cfg: DecodeConfig, rt: ModelRuntime) -> None:
        self.cfg = cfg
        self.rt = rt
        self.engine = DecodeEngine(rt, max_batch=cfg.max_batch, on_step=self._on_step)
        self.peers: dict[str, Peer] = {}
        self.seq_peer: dict[str, Peer] = {}  # allocator key -> peer
        self.started = time.monotonic()
        self._listen: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.handoffs = 0
        self._pulling: dict[str, bool] = {}  # key -> aborted while its pull was in flight
        self.puller = Puller(rt)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._listen = daemon.bind_unix_socket(self.cfg.link_path, group=self.cfg.socket_group)
        write_pidfile(self.cfg.pidfile)
        self.engine.start()
        self._tasks.add(asyncio.create_task(self._accept_loop(), name="decode-accept"))
        log.info("decode_ready", socket=str(self.cfg.link_path), pid=os.getpid())

    async def shutdown(self) -> None:
        """Stop accepting, drain sequences under the timeout, answer the rest, close everything."""
        log.info("decode_draining", sequences=len(self.engine))
        if self._listen is not None:
            self._listen.close()
            remove_file(self.cfg.link_path)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while len(self.engine) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for seq in self.engine.sequences():
            self._drop(seq, ErrorCode.SHUTTING_DOWN, "decode daemon is shutting down")
        for peer in list(self.peers.values()):
            await peer.flush()
            peer.close()
        await self.engine.stop()
        for task in self._tasks:
            task.cancel()
        self.rt.close()
        remove_file(self.cfg.pidfile)
        log.info("decode_stopped")

    # ---- connections ---------------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listen is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listen)
            except OSError:
                return
            if not daemon.peer_allowed(conn, self.cfg.uids(), socket="link"):
                conn.close()
                continue
            task = asyncio.create_task(self._serve_conn(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

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
                while True:
                    self._dispatch(peer, await channel.recv())
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
        finally:
            if peer.pulls:  # never unmap the peer's pool under a copy that still reads it
                await asyncio.gather(*peer.pulls, return_exceptions=True)
            peer.close()

    def _dispatch(self, peer: Peer, msg) -> None:  # type: ignore[no-untyped-def]
        if isinstance(msg, Handoff):
            self._handoff(peer, msg)
        elif isinstance(msg, Ping):
            peer.post(Pong(seq=msg.seq, sent_ns=msg.sent_ns))
        elif isinstance(msg, Abort):
            key = _key(peer, msg.request_id)
            if key in self._pulling:
                self._pulling[key] = True  # freed once the in-flight pull completes
                return
            seq = self.engine.remove(key)
            if seq is None:
                peer.post_error(
                    ErrorCode.CACHE_NOT_EXIST, "ABORT names no request of this link", msg.request_id
                )
            else:
                self._free(seq)
                seq.finish_reason = "abort"
                log.info("request_aborted", request_id=seq.request_id, link=peer.link_id)
        elif isinstance(msg, Status):
            peer.post(self.status())
        elif isinstance(msg, Error):
            peer.log.warning(
                "peer_reported_error", code=msg.code, error=msg.message, request_id=msg.request_id
            )
        else:
            raise ProtocolError(f"unexpected {msg.TYPE.name} on an established link")

    # ---- requests ------------------------------------------------------------------------------
    def _handoff(self, peer: Peer, h: Handoff) -> None:
        recv_ns = time.monotonic_ns()
        key = _key(peer, h.request_id)
        try:
            peer.validate_handoff(h, self.rt.layout.block_size)
            if key in self.seq_peer:
                raise ValueError("request id already in flight on this link")
        except (ValueError, PdkvError) as exc:
            log.warning(
                "handoff_rejected", request_id=h.request_id, link=peer.link_id, error=str(exc)
            )
            peer.post_error(ErrorCode.BAD_REQUEST, str(exc), h.request_id)
            return
        bs = self.rt.layout.block_size
        need = blocks_needed(h.num_tokens, h.sampling.max_tokens, bs)
        if need > self.rt.allocator.total:
            peer.post_error(
                ErrorCode.BAD_REQUEST,
                f"prompt + max_tokens need {need} KV blocks, the decode pool has "
                f"{self.rt.allocator.total} (lower max_tokens or raise the decode's --num-blocks)",
                h.request_id,
            )
            return
        try:
            blocks = self.rt.allocator.allocate(key, need)
        except OutOfBlocks as exc:
            log.info(
                "handoff_no_capacity",
                request_id=h.request_id,
                link=peer.link_id,
                need=need,
                free=exc.free,
            )
            peer.post_error(ErrorCode.NO_CAPACITY, str(exc), h.request_id)
            return
        self.seq_peer[key] = peer
        self._pulling[key] = False
        if self.puller.cuda:
            task = asyncio.create_task(self._pull_async(peer, h, key, blocks, recv_ns))
            peer.pulls.add(task)
            task.add_done_callback(peer.pulls.discard)
        else:
            assert peer.pool is not None
            self.rt.pool.copy_blocks_from(peer.pool, h.block_ids, blocks[: len(h.block_ids)])
            self._pulled(peer, h, key, blocks, recv_ns)

    async def _pull_async(
        self, peer: Peer, h: Handoff, key: str, blocks: list[int], recv_ns: int
    ) -> None:
        try:
            await self.puller.pull(peer, h.block_ids, blocks[: len(h.block_ids)], h.event_slot)
        except Exception as exc:
            log.exception("pull_failed", request_id=h.request_id, link=peer.link_id)
            self._pulling.pop(key, None)
            self.seq_peer.pop(key, None)
            self.rt.allocator.free(key)
            peer.post_error(ErrorCode.INTERNAL, f"pull failed: {exc}", h.request_id)
            return
        self._pulled(peer, h, key, blocks, recv_ns)

    def _pulled(self, peer: Peer, h: Handoff, key: str, blocks: list[int], recv_ns: int) -> None:
        """The copy is complete: RELEASE, then join the batch (unless aborted meanwhile)."""
        done_ns = time.monotonic_ns()
        aborted = self._pulling.pop(key, True)
        peer.post(Release(request_id=h.request_id, event_slot=h.event_slot))
        peer.handoffs += 1
        self.handoffs += 1
        if aborted or peer.closed:
            self.seq_peer.pop(key, None)
            if key in self.rt.allocator:
                self.rt.allocator.free(key)
            return
        seq = Sequence(
            request_id=h.request_id,
            peer=peer.link_id,
            prompt_len=h.num_tokens,
            generated=[h.first_token],
            blocks=blocks,
            sampling=h.sampling,
            stop_ids=self.rt.model.config.stop_token_ids,
            block_size=self.rt.layout.block_size,
            handoff_us=(done_ns - h.sent_ns) / 1000 if h.sent_ns else 0.0,
            pull_us=(done_ns - recv_ns) / 1000,
        )
        if seq.check_finished():
            peer.post(self._finished(peer, seq))  # nothing left to decode
            return
        self.engine.add(seq)
        log.debug(
            "handoff_accepted",
            request_id=h.request_id,
            link=peer.link_id,
            blocks=len(h.block_ids),
            pull_us=round(seq.pull_us, 1),
        )

    def _on_step(self, results: list[tuple[Sequence, int]]) -> None:
        """After a step: each link gets its sequences' TOKENS (and FINISHes) in one write."""
        out: dict[str, tuple[Peer, list[Message]]] = {}
        for seq, tok in results:
            peer = self.seq_peer.get(seq.key)
            if peer is None:
                continue
            msgs = out.setdefault(peer.link_id, (peer, []))[1]
            msgs.append(Tokens(request_id=seq.request_id, tokens=[tok]))
            if seq.finish_reason:
                msgs.append(self._finished(peer, seq))
        for peer, msgs in out.values():
            peer.post_many(msgs)

    def _finished(self, peer: Peer, seq: Sequence) -> Finish:
        """Free a finished sequence's blocks; its FINISH (the prefill logs the request's line)."""
        self._free(seq)
        decode_ms = (time.monotonic() - seq.started) * 1000
        log.debug(
            "sequence_finished",
            request_id=seq.request_id,
            link=peer.link_id,
            reason=seq.finish_reason,
            completion_tokens=len(seq.generated),
            decode_ms=round(decode_ms, 2),
        )
        return Finish(
            request_id=seq.request_id,
            reason=seq.finish_reason or "stop",
            usage=Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.generated)),
            timings={
                "decode_handoff_us": round(seq.handoff_us, 1),
                "pull_us": round(seq.pull_us, 1),
                "decode_ms": round(decode_ms, 3),
            },
        )

    def _free(self, seq: Sequence) -> None:
        key = seq.key
        self.seq_peer.pop(key, None)
        if key in self.rt.allocator:
            self.rt.allocator.free(key)

    def _drop(self, seq: Sequence, code: ErrorCode, message: str) -> None:
        peer = self.seq_peer.get(seq.key)
        self.engine.remove(seq.key)
        self._free(seq)
        if peer is not None:
            peer.post_error(code, message, seq.request_id)

    def _peer_closed(self, peer: Peer) -> None:
        """Link lost: drop its sequences and free their blocks (mappings close in Peer.close)."""
        self.peers.pop(peer.link_id, None)
        dropped = 0
        for seq in self.engine.sequences():
            if seq.peer == peer.link_id:
                self.engine.remove(seq.key)
                self._free(seq)
                dropped += 1
        if dropped:
            log.warning("link_lost_sequences_dropped", link=peer.link_id, dropped=dropped)

    def status(self) -> StatusReply:
        now = time.monotonic()
        return StatusReply(
            role="decode",
            pid=os.getpid(),
            uptime_s=round(now - self.started, 3),
            pool=self.rt.pool_stats(),
            inflight=len(self.engine),
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


def _key(peer: Peer, request_id: str) -> str:
    return f"{peer.link_id}/{request_id}"


async def serve(cfg: DecodeConfig) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, exit code."""
    check_free(cfg.link_path, cfg.pidfile)  # fail fast, before loading the model
    return await daemon.serve_until_stopped(
        lambda: ModelRuntime.load(cfg, "decode"),
        lambda rt: DecodeServer(cfg, rt),
        ModelRuntime.close,
    )
