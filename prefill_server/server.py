"""The prefill daemon: client front door, prefill + scatter, handoff, leases, relay of answers.

Per request: validate, wait for pool capacity (bounded), allocate, prefill on the torch thread,
send the first token to the client, lease the blocks to the link and send HANDOFF; RELEASE frees the
blocks; TOKENS/FINISH are relayed to the client. A lease that outlives `lease_timeout_s`, a lost
link and a client that goes away each end the request and free its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid

import structlog
import torch

from common import daemon
from common.config import PrefillConfig
from common.errors import PdkvError, ProtocolError
from common.ipc.backends import backend_for
from common.ipc.events import event_ring
from common.channel import FrameChannel
from common.model.sampling import SamplingParamsError
from common.modelrt import ModelRuntime
from common.protocol import (
    Abort,
    ConnectionClosed,
    Error,
    ErrorCode,
    Finish,
    Generate,
    Message,
    Release,
    Status,
    StatusReply,
    Tokens,
    make_error,
)
from common.rundir import check_free, remove_file, write_pidfile
from prefill_server.link import DecodeLink
from prefill_server.pipeline import RequestFailed, RequestPipeline
from prefill_server.request import PrefillRequest

log = structlog.get_logger(__name__)
_PARTIAL_FRAME_TIMEOUT_S = 30.0


class PrefillServer:
    def __init__(self, cfg: PrefillConfig, rt: ModelRuntime) -> None:
        self.cfg = cfg
        self.rt = rt
        self.requests: dict[str, PrefillRequest] = {}
        self.started = time.monotonic()
        if rt.device.type == "cuda":
            torch.cuda.set_device(rt.device)  # CUDA calls from the loop thread: export, events
        self.region = backend_for(rt.backend).export(rt.pool.tensor)  # once per process
        # interprocess events exported once per link; CPU needs none (the frame is the signal)
        self.events = event_ring(cfg.event_slots, rt.device) if rt.device.type == "cuda" else None
        self.link = DecodeLink(
            cfg,
            fingerprint=rt.fingerprint,
            backend=rt.backend,
            layout_wire=rt.layout.to_wire(),
            region=self.region,
            event_handles=self.events.handles() if self.events is not None else [],
            on_message=self._on_link_message,
            on_lost=self._on_link_lost,
        )
        self.pipeline = RequestPipeline(self)
        self._listen: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self.served = 0

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._listen = daemon.bind_unix_socket(self.cfg.client_path, group=self.cfg.socket_group)
        write_pidfile(self.cfg.pidfile)
        self.link.start()
        accept = daemon.accept_loop(
            self._listen,
            self.cfg.uids(),
            lambda conn: self._serve_client(FrameChannel(conn)),
            self._tasks,
            name="client",
        )
        self._spawn(accept, "prefill-accept")
        self._spawn(self._lease_reaper(), "lease-reaper")
        log.info("prefill_ready", socket=str(self.cfg.client_path), pid=os.getpid())

    async def shutdown(self) -> None:
        """Stop accepting, drain in-flight requests under the timeout, fail the rest, close."""
        self.stopping = True
        log.info("prefill_draining", requests=len(self.requests))
        if self._listen is not None:
            self._listen.close()
            remove_file(self.cfg.client_path)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for req in list(self.requests.values()):
            req.inbox.put_nowait(
                Error(code=ErrorCode.SHUTTING_DOWN, message="prefill daemon is shutting down")
            )
        await asyncio.sleep(0.05)
        try:
            async with asyncio.timeout(5):
                await self.link.stop()
        except TimeoutError:
            log.warning("link_stop_timeout")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.rt.close()
        self.region.close()
        if self.events is not None:
            self.events.close()
        remove_file(self.cfg.pidfile)
        log.info("prefill_stopped", served=self.served)

    def _spawn(self, coro, name: str) -> asyncio.Task[None]:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- client connections --------------------------------------------------------------------
    async def _serve_client(self, channel: FrameChannel) -> None:
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
                    mine[rid] = self._spawn(self._run_request(channel, rid, msg), f"req-{rid}")
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

    # ---- link ----------------------------------------------------------------------------------
    def _on_link_message(self, msg: Message) -> None:
        rid = getattr(msg, "request_id", None)
        req = self.requests.get(rid) if rid else None
        if req is None:
            if isinstance(msg, Release):
                self.pipeline.unquarantine(msg.event_slot)
            elif not isinstance(msg, Finish | Tokens):
                log.warning("link_message_for_unknown_request", type=msg.TYPE.name, request_id=rid)
            return
        if isinstance(msg, Release):
            self.pipeline.on_release(req, msg)
        else:
            req.inbox.put_nowait(msg)

    def _on_link_lost(self, link_id: str, reason: str) -> None:
        freed = self.rt.allocator.release_holder(link_id) if link_id else []
        for req in self.requests.values():
            if req.handed_off:
                req.inbox.put_nowait(
                    Error(code=ErrorCode.LINK_LOST, message=f"link to decode lost: {reason}")
                )
        if freed:
            log.warning("leases_reclaimed", link=link_id, requests=len(freed))
        self.pipeline.unquarantine_all()  # the peer closed its event handles with the link
        self.pipeline.capacity_changed()

    async def _lease_reaper(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.cfg.lease_timeout_s / 4))
            for rid in self.rt.allocator.expired(time.monotonic()):
                self.rt.allocator.free(rid)
                req = self.requests.get(rid)
                log.warning("lease_expired", request_id=rid)
                if req is not None:
                    req.inbox.put_nowait(
                        Error(code=ErrorCode.WAIT_TIMEOUT, message="decode did not release in time")
                    )
                self.pipeline.capacity_changed()

    def status(self) -> StatusReply:
        return StatusReply(
            role="prefill",
            pid=os.getpid(),
            uptime_s=round(time.monotonic() - self.started, 3),
            pool=self.rt.pool_stats(),
            inflight=len(self.requests),
            links=[
                {
                    "link": self.link.link_id,
                    "state": self.link.state,
                    "connects": self.link.connects,
                    "rtt_us": round(self.link.rtt_us, 1),
                    "last_error": self.link.last_error,
                }
            ],
            device=str(self.rt.device),
            backend=self.rt.backend,
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
