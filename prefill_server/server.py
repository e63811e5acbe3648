"""The prefill daemon: the client front door, wired to the request pipeline, the link and the
KV producer.

Per client connection: GENERATE starts a request task that runs RequestPipeline.run and writes
its frames to the client through the connection's ClientWriter (which the pipeline may also give
the decode's TOKENS itself, from the link's read callback); ABORT cancels one; STATUS answers.
The server is the composition root: it builds the Producer (the pool exported once), a
DecodeLink per decode daemon (DecodeLinks) and the RequestPipeline over them, and starts each
link with the pipeline as its listener; nothing below holds the server. Life cycle and STATUS
are common.daemon.server.DaemonServer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog

from common.daemon import lifecycle
from common.daemon.rundir import check_free
from common.daemon.runtime import ModelRuntime
from common.daemon.server import DaemonServer
from common.daemon.throughput import Throughput
from common.errors import PdkvError, ProtocolError
from common.model.sampling import SamplingParamsError
from common.protocol import (
    Abort,
    ConnectionClosed,
    ErrorCode,
    Generate,
    Message,
    Status,
    make_error,
)
from common.wire.channel import FrameChannel
from prefill_server.client_writer import ClientWriter
from prefill_server.config import PrefillConfig
from prefill_server.decode_links import DecodeLinks
from prefill_server.handshake import check_decode_option, make_producer
from prefill_server.link import DecodeLink
from prefill_server.pipeline import RequestPipeline
from prefill_server.request import RequestFailed
from prefill_server.startup import load_runtime

log = structlog.get_logger(__name__)


class PrefillServer(DaemonServer):
    role = "prefill"
    in_flight_name = "requests"
    peer_name = "client"

    def __init__(self, cfg: PrefillConfig, rt: ModelRuntime, stop: lifecycle.StopFlag) -> None:
        super().__init__(cfg, rt, cfg.client_path, stop)
        self.cfg: PrefillConfig = cfg
        self.producer = make_producer(cfg, rt)
        self.decodes = DecodeLinks(
            [
                DecodeLink(
                    cfg,
                    address,
                    fingerprint=rt.fingerprint,
                    compat=rt.compat,
                    backend=rt.backend,
                    producer=self.producer,
                )
                for address in check_decode_option(cfg)
            ]
        )
        self.pipeline = RequestPipeline(cfg, rt, self.producer, self.decodes)

    # ---- life cycle ------------------------------------------------------------------------------
    def start_parts(self) -> None:
        for link in self.decodes:
            link.start(self.pipeline)  # its frames and losses go to the pipeline
        self.spawn(self.pipeline.reap_leases(), "lease-reaper")
        batcher = self.spawn(self.pipeline.batcher.run(), "prefill-batcher")
        batcher.add_done_callback(self._batcher_ended)

    def _batcher_ended(self, task: asyncio.Task[None]) -> None:
        """The batcher only ends by the shutdown's cancel; if it died, nothing here prefills any
        more, so the daemon ends (non-zero) rather than accept requests that would hang."""
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.stop_flag.fail(f"prefill batcher failed: {type(exc).__name__}: {exc}")

    def in_flight(self) -> int:
        return len(self.pipeline.live())

    def refuse_new(self) -> None:
        self.pipeline.stopping = True

    async def end_remaining(self) -> None:
        self.pipeline.shut_down()
        await asyncio.sleep(0.05)
        try:
            async with asyncio.timeout(5):
                await self.decodes.stop()
        except TimeoutError:
            log.warning("link_stop_timeout")

    def close_parts(self) -> None:
        self.producer.close()

    async def until_ready(self) -> None:
        """Ready once the client socket listens (start) and a link to a decode is up."""
        while not self.decodes.up():
            waits = [asyncio.ensure_future(link.ready.wait()) for link in self.decodes]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    @property
    def throughput(self) -> Throughput:
        return self.pipeline.throughput

    def log_stopped(self) -> dict[str, Any]:
        relayed = self.pipeline.relay.counts
        return {
            "served": self.pipeline.throughput.served,
            "relayed_direct": relayed["direct"],
            "relayed_queued": relayed["queued"],
        }

    def links(self) -> list[dict[str, Any]]:
        return [
            {
                "link": link.link_id,
                "decode": link.address,
                "state": link.state,
                "connects": link.connects,
                "rtt_us": round(link.rtt_us, 1),
                "last_error": link.last_error,
                "requests": link.load.mine,
                "decode_sequences": link.load.sequences,
                "decode_free_blocks": link.load.free_blocks,
            }
            for link in self.decodes
        ]

    # ---- client connections ----------------------------------------------------------------------
    async def serve_connection(self, conn: socket.socket) -> None:
        channel = FrameChannel(conn, max_fds=0)
        client = _Client(
            channel, ClientWriter(channel, write_timeout_s=self.cfg.client_write_timeout_s)
        )
        writer, mine = client.writer, client.mine
        # neither a client that trickles a frame nor one that sits idle holds its fd forever
        watchdog = asyncio.create_task(self._watch_client(client))
        try:
            while True:
                msg = await channel.recv()
                read_ns = time.monotonic_ns()
                if isinstance(msg, Generate):
                    rid = msg.request_id or uuid.uuid4().hex[:16]
                    if rid in mine:
                        await writer.send(
                            make_error(ErrorCode.BAD_REQUEST, "request id already in flight", rid)
                        )
                        continue
                    run = self._run_request(writer, rid, msg, read_ns)
                    mine[rid] = self.spawn(run, f"req-{rid}")
                    mine[rid].add_done_callback(lambda _t, r=rid: client.done(r))
                elif isinstance(msg, Abort):
                    task = mine.pop(msg.request_id, None)
                    if task is None:
                        await writer.send(
                            make_error(ErrorCode.CACHE_NOT_EXIST, "no such request", msg.request_id)
                        )
                    else:
                        task.cancel()
                elif isinstance(msg, Status):
                    await writer.send(self.status())
                else:
                    raise ProtocolError(f"unexpected {msg.TYPE.name} on the client socket")
        except ProtocolError as exc:
            log.warning("client_protocol_error", error=str(exc))
            with contextlib.suppress(OSError):
                await writer.send(make_error(ErrorCode.PROTOCOL_ERROR, str(exc)))
        except TimeoutError as exc:  # an OSError: before the clause below
            log.info("client_connection_timed_out", error=str(exc))
        except (ConnectionClosed, OSError):
            pass
        finally:
            watchdog.cancel()
            for task in mine.values():
                task.cancel()  # the client went away: abort what it still waits for
            writer.flush()  # what is queued still goes out, ahead of the close
            channel.close()

    async def _watch_client(self, client: _Client) -> None:
        """End a client connection whose frame has been incomplete for frame_timeout_s, or that
        has had no request in flight and sent nothing for client_idle_timeout_s."""
        channel = client.channel
        frame_s, idle_s = self.cfg.frame_timeout_s, self.cfg.client_idle_timeout_s
        while not channel.closed:
            await asyncio.sleep(min(frame_s, idle_s) / 4)
            now = time.monotonic()
            if channel.partial_age(now) >= frame_s:
                channel.fail(TimeoutError(f"a frame not completed within {frame_s} s"))
                return
            if not client.mine and now - max(channel.last_rx, client.last_done) >= idle_s:
                channel.fail(TimeoutError(f"idle for {idle_s} s with no request in flight"))
                return

    async def _run_request(
        self, writer: ClientWriter, rid: str, msg: Generate, read_ns: int = 0
    ) -> None:
        """Every request ends with FINISH or ERROR to its client, unless the client is gone.
        Only a failed write to the client counts as gone: an OSError from the pipeline (the
        link, the model) is the request's failure and is answered like any other. Frames go
        through the connection's ClientWriter: no wait and no timer per token unless the client
        has fallen behind; the pipeline may relay the decode's TOKENS to `writer` itself, from
        the link's read callback, while this task waits (prefill_server/relay.py)."""
        rlog = log.bind(request_id=rid)
        try:
            outputs_of = self.pipeline.run(rid, msg, writer, read_ns)
            async with contextlib.aclosing(outputs_of) as outputs:
                async for out in outputs:
                    try:
                        await writer.send(out)
                    except TimeoutError:  # (an OSError: before the clause below)
                        # its blocks are freed and the decode told to abort as the pipeline
                        # closes; the connection ends too (a frame may be half written)
                        rlog.warning(
                            "client_not_reading", timeout_s=self.cfg.client_write_timeout_s
                        )
                        writer.channel.close()
                        return
                    except OSError:
                        rlog.info("client_gone")
                        return
        except RequestFailed as exc:
            rlog.warning("request_failed", code=exc.code, error=str(exc))
            await _send_quietly(writer, make_error(exc.code, str(exc), rid))
        except (SamplingParamsError, PdkvError) as exc:
            rlog.warning("request_rejected", error=str(exc))
            await _send_quietly(writer, make_error(ErrorCode.BAD_REQUEST, str(exc), rid))
        except asyncio.CancelledError:
            rlog.info("request_cancelled")
        except Exception as exc:  # a bug must not leave the client waiting
            rlog.exception("request_internal_error")
            await _send_quietly(
                writer, make_error(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", rid)
            )


@dataclass
class _Client:
    """One client connection: its requests in flight, and when the last one ended (the idle
    clock runs from the later of that and the last frame received)."""

    channel: FrameChannel
    writer: ClientWriter  # every frame to this client goes through it, in order
    mine: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    last_done: float = 0.0

    def done(self, rid: str) -> None:
        self.mine.pop(rid, None)
        self.last_done = time.monotonic()


async def _send_quietly(writer: ClientWriter, msg: Message) -> None:
    with contextlib.suppress(OSError):
        await writer.send(msg)


async def serve(cfg: PrefillConfig) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, exit code."""
    check_free(cfg.client_path, cfg.pidfile)  # fail fast, before loading the model
    check_decode_option(cfg)
    return await lifecycle.serve_until_stopped(
        lambda: load_runtime(cfg),
        lambda rt, stop: PrefillServer(cfg, rt, stop),
        ModelRuntime.close,
    )
