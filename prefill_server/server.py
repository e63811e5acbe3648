"""The prefill daemon: the client front door, wired to the request pipeline, the link and the
KV producer.

Per client connection: GENERATE starts a request task that runs RequestPipeline.run and writes its
frames to the client; ABORT cancels one; STATUS answers. The server is the composition root: it
builds the KVProducer (the pool exported once), the DecodeLink and the RequestPipeline, and routes
the link's frames into the pipeline; nothing below holds the server. Life cycle and STATUS are
common.server.DaemonServer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from typing import Any

import structlog

from common import daemon
from common.channel import FrameChannel
from common.config import PrefillConfig
from common.errors import PdkvError, ProtocolError
from common.model.sampling import SamplingParamsError
from common.modelrt import ModelRuntime
from common.protocol import (
    Abort,
    ConnectionClosed,
    ErrorCode,
    Generate,
    Message,
    Status,
    make_error,
)
from common.rundir import check_free
from common.server import DaemonServer
from common.throughput import Throughput
from common.transfer import KVProducer
from prefill_server.link import DecodeLink
from prefill_server.pipeline import RequestPipeline
from prefill_server.request import RequestFailed

log = structlog.get_logger(__name__)
_PARTIAL_FRAME_TIMEOUT_S = 30.0


class PrefillServer(DaemonServer):
    role = "prefill"
    in_flight_name = "requests"

    def __init__(self, cfg: PrefillConfig, rt: ModelRuntime) -> None:
        super().__init__(cfg, rt, cfg.client_path)
        self.cfg: PrefillConfig = cfg
        self.producer = KVProducer(rt.pool, rt.allocator, rt.backend, event_slots=cfg.event_slots)
        self.link = DecodeLink(
            cfg,
            fingerprint=rt.fingerprint,
            backend=rt.backend,
            producer=self.producer,
            on_message=lambda msg: self.pipeline.deliver(msg),
            on_lost=lambda link_id, reason: self.pipeline.link_lost(link_id, reason),
        )
        self.pipeline = RequestPipeline(cfg, rt, self.producer, self.link)

    # ---- life cycle ------------------------------------------------------------------------------
    def start_parts(self) -> None:
        self.link.start()
        self.spawn(self.pipeline.reap_leases(), "lease-reaper")

    def in_flight(self) -> int:
        return len(self.pipeline.requests)

    def refuse_new(self) -> None:
        self.pipeline.stopping = True

    async def end_remaining(self) -> None:
        self.pipeline.shut_down()
        await asyncio.sleep(0.05)
        try:
            async with asyncio.timeout(5):
                await self.link.stop()
        except TimeoutError:
            log.warning("link_stop_timeout")

    def close_parts(self) -> None:
        self.producer.close()

    async def until_ready(self) -> None:
        """Ready once the client socket listens (start) and the link to the decode is up."""
        await self.link.ready.wait()

    @property
    def throughput(self) -> Throughput:
        return self.pipeline.throughput

    def log_stopped(self) -> dict[str, Any]:
        return {"served": self.pipeline.throughput.served}

    def links(self) -> list[dict[str, Any]]:
        link = self.link
        return [
            {
                "link": link.link_id,
                "state": link.state,
                "connects": link.connects,
                "rtt_us": round(link.rtt_us, 1),
                "last_error": link.last_error,
            }
        ]

    # ---- client connections ----------------------------------------------------------------------
    async def serve_connection(self, conn: socket.socket) -> None:
        channel = FrameChannel(conn)
        mine: dict[str, asyncio.Task[None]] = {}
        # a client that sends half a frame and stalls must not hold its fd forever
        watchdog = asyncio.create_task(
            channel.watch_idle(_PARTIAL_FRAME_TIMEOUT_S, partial_only=True)
        )
        try:
            while True:
                msg = await channel.recv()
                if isinstance(msg, Generate):
                    rid = msg.request_id or uuid.uuid4().hex[:16]
                    if rid in mine:
                        await channel.send(
                            make_error(ErrorCode.BAD_REQUEST, "request id already in flight", rid)
                        )
                        continue
                    mine[rid] = self.spawn(self._run_request(channel, rid, msg), f"req-{rid}")
                    mine[rid].add_done_callback(lambda _t, r=rid: mine.pop(r, None))
                elif isinstance(msg, Abort):
                    task = mine.pop(msg.request_id, None)
                    if task is None:
                        await channel.send(
                            make_error(ErrorCode.CACHE_NOT_EXIST, "no such request", msg.request_id)
                        )
                    else:
                        task.cancel()
                elif isinstance(msg, Status):
                    await channel.send(self.status())
                else:
                    raise ProtocolError(f"unexpected {msg.TYPE.name} on the client socket")
        except ProtocolError as exc:
            log.warning("client_protocol_error", error=str(exc))
            with contextlib.suppress(OSError):
                await channel.send(make_error(ErrorCode.PROTOCOL_ERROR, str(exc)))
        except (ConnectionClosed, OSError):
            pass
        except TimeoutError as exc:
            log.warning("client_stalled", error=str(exc))
        finally:
            watchdog.cancel()
            for task in mine.values():
                task.cancel()  # the client went away: abort what it still waits for
            channel.close()

    async def _run_request(self, channel: FrameChannel, rid: str, msg: Generate) -> None:
        """Every request ends with FINISH or ERROR to its client, unless the client is gone.
        Only a failed write to the client counts as gone: an OSError from the pipeline (the
        link, the model) is the request's failure and is answered like any other."""
        rlog = log.bind(request_id=rid)
        try:
            async with contextlib.aclosing(self.pipeline.run(rid, msg)) as outputs:
                async for out in outputs:
                    try:
                        await channel.send(out)
                    except OSError:
                        rlog.info("client_gone")
                        return
        except RequestFailed as exc:
            rlog.warning("request_failed", code=exc.code, error=str(exc))
            await _send_quietly(channel, make_error(exc.code, str(exc), rid))
        except (SamplingParamsError, PdkvError) as exc:
            rlog.warning("request_rejected", error=str(exc))
            await _send_quietly(channel, make_error(ErrorCode.BAD_REQUEST, str(exc), rid))
        except asyncio.CancelledError:
            rlog.info("request_cancelled")
        except Exception as exc:  # a bug must not leave the client waiting
            rlog.exception("request_internal_error")
            await _send_quietly(
                channel, make_error(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", rid)
            )


async def _send_quietly(channel: FrameChannel, msg: Message) -> None:
    with contextlib.suppress(OSError):
        await channel.send(msg)


async def serve(cfg: PrefillConfig) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, exit code."""
    check_free(cfg.client_path, cfg.pidfile)  # fail fast, before loading the model
    return await daemon.serve_until_stopped(
        lambda: ModelRuntime.load(cfg, "prefill"),
        lambda rt: PrefillServer(cfg, rt),
        ModelRuntime.close,
    )
