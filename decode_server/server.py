"""The decode daemon: accepts links from prefill daemons, and per link runs the handshake and then
hands each frame to DecodeRequests (requests.py), which pulls the KV and decodes in batches.

One way down: server → Peer (the link: channel, Consumer) and DecodeRequests (the request table,
the engine). A link that ends is taken down from here: its pulls drained, its sequences dropped,
then its peer closed. Life cycle and STATUS are common.daemon.server.DaemonServer's.

With `--listen tcp://ADDR:PORT` the daemon also accepts links from other hosts (common.wire.tcplink):
those prove the shared key in the handshake, and their KV moves through the "tcp" transport's
consumer side (this daemon's one NIXL agent). The Unix socket serves as before. Each link's
consumer comes from its kind's ConsumerSide (common.transfer.registry), opened once per daemon:
the server never names a transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
from typing import Any

import msgspec
import structlog

from common.daemon import lifecycle
from common.daemon.rundir import check_free
from common.daemon.runtime import ModelRuntime
from common.daemon.server import DaemonServer
from common.daemon.throughput import Throughput
from common.errors import PdkvError, ProtocolError
from common.protocol import (
    Abort,
    ConnectionClosed,
    Error,
    ErrorCode,
    Handoff,
    Hello,
    KvLaunched,
    KvReady,
    Message,
    Ping,
    Pong,
    Register,
    Status,
)
from common.transfer.registry import TCP, UNIX, ConsumerSide, transport
from common.wire.channel import MAX_FDS_HELD, FrameChannel
from common.wire.tcplink import TcpSettings, is_tcp, listen_tcp, tcp_settings, tune
from decode_server.config import DecodeConfig
from decode_server.peer import HandshakeError, Peer
from decode_server.requests import DecodeRequests
from decode_server.startup import load_runtime

log = structlog.get_logger(__name__)
#: a refused handshake with the same reason is logged at warning at most this often
REFUSAL_LOG_INTERVAL_S = 60.0
#: after an early HANDOFF on a link whose prefill runs on none of our CPUs, poll that link for
#: its KV_READY (due within one prefill forward) at most this long, while nothing else is to
#: be done: a KV_READY that wakes a loop asleep in epoll waits for its vCPU to wake first
#: (100-200 µs on a 2-vCPU VM), a polled one is read at once. A CPU of our own costs no one.
AWAIT_KV_SPIN_S = 0.05


class DecodeServer(DaemonServer):
    role = "decode"
    in_flight_name = "sequences"
    peer_name = "link"

    def __init__(self, cfg: DecodeConfig, rt: ModelRuntime, stop: lifecycle.StopFlag) -> None:
        super().__init__(cfg, rt, cfg.link_path, stop)
        self.cfg: DecodeConfig = cfg
        self._spin_s = cfg.spin_us / 1e6
        overlap = cfg.overlap_mode(rt.device.type)
        warm = cfg.warm_wait_on(rt.device.type)
        self.requests = DecodeRequests(
            rt,
            max_batch=cfg.max_batch,
            overlap=overlap,
            warm_wait=warm,
            prefill_first_ms=cfg.prefill_first_for(rt.device.type),
        )
        self._decoding: asyncio.Task[None] | None = None  # DecodeRequests.run
        self._failure: BaseException | None = None  # why the decode loop ended, if it did
        self.peers: dict[str, Peer] = {}
        loop = asyncio.get_running_loop()
        # per link kind, what its links' consumers share (CUDA: the one pull stream; NIXL: the
        # agent, with the pool registered once, added when --listen starts)
        self.sides: dict[str, ConsumerSide] = {UNIX: transport(UNIX).consumer_side(rt.pool, loop)}
        self.tcp: TcpSettings | None = check_listen(cfg)
        self._tcp_listen: socket.socket | None = None
        self._refusals: dict[str, lifecycle.RateLimitedLog] = {}  # reason -> its rate-limited log
        self.kv_ready_polled = 0  # KV_READYs read while the loop polled their link (spin)

    # ---- life cycle ------------------------------------------------------------------------------
    def start_parts(self) -> None:
        self._decoding = asyncio.create_task(self._decode(), name="decode-loop")
        if self.tcp is not None:
            side = transport(TCP).consumer_side(self.rt.pool, asyncio.get_running_loop())
            self.sides[TCP] = side
            self._tcp_listen = listen_tcp(self.tcp.host, self.tcp.port)
            accept = lifecycle.accept_loop(
                self._tcp_listen,
                None,
                self.serve_connection,
                self._tasks,
                name="tcp-link",
                max_connections=self.cfg.max_connections,
            )
            self.spawn(accept, "decode-accept-tcp")
            log.info("decode_listening_tcp", listen=self.cfg.listen, consumers=side.name)

    async def _decode(self) -> None:
        """Run the decode loop; if a step fails, nothing here decodes any more: the daemon ends
        (exit status 1)."""
        engine = self.requests.engine
        mode = self.requests.overlap
        warm = engine.warm_waits_enabled
        first = self.requests.prefill_first
        log.info(
            "decode_loop_started",
            max_batch=engine.max_batch,
            overlap_steps=mode,
            warm_wait=warm,
            prefill_first_ms=self.cfg.prefill_first_for(self.rt.device.type),
        )
        try:
            await self.requests.run()
        except asyncio.CancelledError:  # the shutdown: what the loop did, for the log
            log.info(
                "decode_loop_stopped",
                steps=engine.steps,
                overlapped=engine.overlapped,
                held=engine.held,
                warm_waits=engine.warm_waits,
                kv_ready_polled=self.kv_ready_polled,
                launched_first=self.requests.launched_first,
                prefill_first_holds=None if first is None else first.holds,
                prefill_first_timeouts=None if first is None else first.timeouts,
                prefill_first_held_s=None if first is None else round(first.held_s, 3),
            )
            raise
        except Exception as exc:  # not attributable to one sequence
            self._failure = exc
            log.critical("decode_loop_failed", batch=len(self.requests), exc_info=exc)
            self.stop_flag.fail(f"decode loop failed: {type(exc).__name__}: {exc}")

    def refuse_new(self) -> None:
        if self._tcp_listen is not None:
            self._tcp_listen.close()

    def close_parts(self) -> None:
        for side in self.sides.values():
            side.close()

    def in_flight(self) -> int:
        return len(self.requests.sequences())  # those awaiting a first token or a NIXL copy too

    def failure(self) -> BaseException | None:
        return self._failure

    def _refusal_log(self, reason: str) -> lifecycle.RateLimitedLog:
        if len(self._refusals) > 64:  # reasons name peers' fields: keep the table small
            self._refusals.clear()
        return self._refusals.setdefault(
            reason, lifecycle.RateLimitedLog("handshake_refused", REFUSAL_LOG_INTERVAL_S)
        )

    async def end_remaining(self) -> None:
        code, why = ErrorCode.SHUTTING_DOWN, "decode daemon is shutting down"
        if self.failure() is not None:
            code, why = ErrorCode.INTERNAL, "decode daemon failed and is exiting (see its log)"
        self.requests.shutdown(code, why)
        for peer in list(self.peers.values()):
            await peer.flush()
            await self._end_link(peer)
        if self._decoding is not None:
            self._decoding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._decoding

    @property
    def throughput(self) -> Throughput:
        return self.requests.throughput

    def links(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "link": p.link_id,
                "peer_pid": p.pid,
                "age_s": round(now - p.connected_at, 1),
                "handoffs": p.handoffs,
                "transport": p.kind,
            }
            for p in self.peers.values()
        ]

    # ---- links -----------------------------------------------------------------------------------
    async def serve_connection(self, conn: socket.socket) -> None:
        tcp = is_tcp(conn)
        if tcp:
            tune(conn, self.cfg.heartbeat_timeout_s)
        channel = FrameChannel(conn, max_fds=0 if tcp else MAX_FDS_HELD)
        kind = TCP if tcp else UNIX
        key = self.tcp.key if tcp and self.tcp is not None else None
        peer = Peer(channel, kind, key, same_host=transport(kind).same_host)
        try:
            await self._serve_link(peer)
        except HandshakeError as exc:
            # a mismatched prefill retries every 2 s: one warning a minute per reason
            self._refusal_log(f"{exc.code}: {exc}").note(peer.log, code=exc.code, error=str(exc))
            await self._answer(peer, exc.code, str(exc))
        except ProtocolError as exc:
            peer.log.warning("protocol_error", error=str(exc))
            await self._answer(peer, ErrorCode.PROTOCOL_ERROR, str(exc))
        except TimeoutError:
            peer.log.warning("link_heartbeat_missed", timeout_s=self.cfg.heartbeat_timeout_s)
        except (ConnectionClosed, OSError) as exc:
            peer.log.info("link_closed", reason=str(exc) or type(exc).__name__)
        except PdkvError as exc:  # nothing may escape the connection's task
            peer.log.warning("link_failed", error=str(exc))
            await self._answer(peer, ErrorCode.PROTOCOL_ERROR, str(exc))
        except Exception as exc:  # a bug: end this link only, loudly
            peer.log.exception("link_failed_internal")
            await self._answer(peer, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            await self._end_link(peer)

    async def _serve_link(self, peer: Peer) -> None:
        """Handshake (or one STATUS), then every frame of the link until it ends."""
        channel, timeout = peer.channel, self.cfg.heartbeat_timeout_s
        async with asyncio.timeout(timeout):
            first = await channel.recv()
        if isinstance(first, Status) and peer.key is None:  # a TCP peer proves the key first
            peer.post(self.status())
            await peer.flush()
            return
        if not isinstance(first, Hello):
            raise ProtocolError(f"expected HELLO first, got {first.TYPE.name}")
        peer.post(peer.check_hello(first, self.rt.fingerprint, self.rt.compat))
        async with asyncio.timeout(timeout):
            reg = await channel.recv()
        if isinstance(reg, Error):  # the prefill refused us (e.g. our key proof was wrong)
            peer.log.warning("link_refused_by_peer", code=reg.code, error=reg.message)
            return
        if not isinstance(reg, Register):
            raise ProtocolError(f"expected REGISTER after HELLO, got {reg.TYPE.name}")
        registered = peer.register(reg, self.sides[peer.kind])
        # its first-time costs now, before the prefill may send HANDOFFs (REGISTERED)
        self.requests.warm_pull(peer)
        peer.post(registered)
        channel.max_fds = 0  # no later frame carries fds: any that come are closed at once
        self.peers[peer.link_id] = peer
        watchdog = asyncio.create_task(
            channel.watch_idle(timeout, frame_timeout=self.cfg.frame_timeout_s)
        )
        try:
            await channel.dispatch(lambda msg: self._dispatch(peer, msg))
        finally:
            watchdog.cancel()

    def _dispatch(self, peer: Peer, msg: Message) -> None:
        if isinstance(msg, (Handoff, KvReady, KvLaunched)) and not peer.same_host and msg.sent_ns:
            msg = msgspec.structs.replace(msg, sent_ns=0)  # another host's clock: not comparable
        if isinstance(msg, Handoff):
            self.requests.handoff(peer, msg)
            peer.channel.spin(self._spin_s)  # handoffs come in bursts: the next may be close
            if msg.first_token is None and peer.cpus_apart:  # its KV_READY comes next
                awaits = functools.partial(self.requests.awaits_kv, peer)
                peer.channel.spin(AWAIT_KV_SPIN_S, while_=awaits)
        elif isinstance(msg, KvReady):  # an early HANDOFF's KV is written: its first token
            self.kv_ready_polled += peer.channel.polled
            self.requests.kv_ready(peer, msg)
        elif isinstance(msg, KvLaunched):  # its forward and first token queued on P's GPU
            self.requests.kv_launched(peer, msg)
        elif isinstance(msg, Ping):  # with our load: a prefill with several decodes picks by it
            free, live = self.rt.allocator.num_free, len(self.requests.sequences())
            peer.post(Pong(seq=msg.seq, sent_ns=msg.sent_ns, free_blocks=free, sequences=live))
        elif isinstance(msg, Abort):
            self.requests.abort(peer, msg.request_id)
        elif isinstance(msg, Status):
            peer.post(self.status())
        elif peer.consumer is not None and msg.TYPE in peer.consumer.caps.frames:
            peer.consumer.handle_frame(msg, peer.post)  # the transport's own (NIXL's PUSH_FAILED)
        elif isinstance(msg, Error):
            peer.log.warning(
                "peer_reported_error", code=msg.code, error=msg.message, request_id=msg.request_id
            )
        else:
            raise ProtocolError(f"unexpected {msg.TYPE.name} on an established link")

    @staticmethod
    async def _answer(peer: Peer, code: ErrorCode, message: str) -> None:
        peer.post_error(code, message)
        await peer.flush()

    async def _end_link(self, peer: Peer) -> None:
        """Top-down teardown of one link (idempotent): forget it, let its pulls finish (never
        unmap the peer's pool under a copy that reads it), drop its sequences, close it."""
        self.peers.pop(peer.link_id, None)
        await peer.drain()
        dropped = self.requests.drop_peer(peer)
        if dropped:
            log.warning("link_lost_sequences_dropped", link=peer.link_id, dropped=dropped)
        peer.close()


def check_listen(cfg: DecodeConfig) -> TcpSettings | None:
    """The --listen address, key and transport, checked (PdkvError saying what to do); None
    without."""
    if cfg.listen is None:
        return None
    settings = tcp_settings(cfg.listen, cfg.link_key_file, "--listen")
    transport(TCP).check()
    return settings


async def serve(cfg: DecodeConfig) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, exit code."""
    check_free(cfg.link_path, cfg.pidfile)  # fail fast, before loading the model
    check_listen(cfg)
    return await lifecycle.serve_until_stopped(
        lambda: load_runtime(cfg),
        lambda rt, stop: DecodeServer(cfg, rt, stop),
        ModelRuntime.close,
    )
