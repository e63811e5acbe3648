"""One NIXL agent per daemon process, over its KV pool: the engine under both NIXL transfer sides.

Contract:
- `load_nixl()` imports NIXL or raises PdkvError saying what to install (`pdkv[nixl]`).
- `NixlAgent(name, tensor)` creates an agent with the UCX backend and registers the pool's memory
  once (DRAM for a CPU tensor, VRAM for a CUDA one). `region(transfer)` is its wire form
  (`common.protocol.NixlRegion`: agent name, metadata, address, length, device, memory type).
- `add_peer(region)` loads a peer's metadata (checked: memory type known, lengths bounded) and
  returns its agent name; `remove_peer(name)` forgets it (UCX disconnects).
- `transfer(op, peer, runs, notif, done)` queues one NIXL READ or WRITE of byte runs
  `[(local_addr, remote_addr, nbytes)]`; `expect(peer, tag, done)` waits for notification `tag`
  from agent `peer`. `new_tag()` numbers transfers once per agent (never reused, so a late
  notification of a link that ended cannot complete another link's transfer). Both call `done(None)` or `done(exc)` exactly once, on the event loop given at
  construction (`call_soon_threadsafe`). Nothing here blocks that loop: one worker thread posts
  transfers, polls their state and the notifications, and sleeps only while something is due.
- `forget(peer)` drops what is awaited from `peer`; `close()` (idempotent) stops the worker,
  fails what is still pending and deregisters the memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import structlog
import torch

from common.errors import PdkvError
from common.protocol import NixlRegion

log = structlog.get_logger(__name__)
Done = Callable[[BaseException | None], None]
Run = tuple[int, int, int]  # (local address, remote address, bytes)

NIXL_MISSING = (
    "NIXL is not installed, and a link across hosts (tcp://) moves the KV with it: "
    "pip install 'pdkv[nixl]'"
)
#: Notifications that arrive before anyone awaits them are kept, up to this many.
MAX_EARLY_NOTIFS = 4096
_names = itertools.count()


def load_nixl() -> Any:
    """The NIXL Python API module, or PdkvError saying what to install."""
    if not torch.cuda.is_available():  # UCX's CUDA transports probe for a driver otherwise
        os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl_cu13 import _api
    except ImportError as exc:
        raise PdkvError(NIXL_MISSING) from exc
    return _api


def nixl_available() -> bool:
    try:
        load_nixl()
    except PdkvError:
        return False
    return True


class NixlTransferError(PdkvError):
    """A NIXL transfer failed or could not be posted; fails that request only."""


class NixlAgent:
    def __init__(self, role: str, tensor: torch.Tensor, loop: asyncio.AbstractEventLoop) -> None:
        api = load_nixl()
        self.name = f"pdkv-{role}-{os.getpid()}-{next(_names)}-{os.urandom(4).hex()}"
        self.mem_type = "VRAM" if tensor.device.type == "cuda" else "DRAM"
        self.device_id = tensor.device.index or 0
        self.addr = tensor.data_ptr()
        self.nbytes = tensor.numel() * tensor.element_size()
        self._tensor = tensor  # the registration must not outlive the memory
        conf = api.nixl_agent_config(
            enable_prog_thread=True,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.agent = api.nixl_agent(self.name, conf)
        self._reg = self.agent.register_memory(
            [(self.addr, self.nbytes, self.device_id, "")], self.mem_type
        )
        self._loop = loop
        self._tags = itertools.count(1)
        self._jobs: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name=f"nixl-{role}", daemon=True)
        self._worker.start()

    def region(self, transfer: str) -> NixlRegion:
        """This agent and its registered pool, as REGISTER/REGISTERED carry them."""
        return NixlRegion(
            agent=self.name,
            metadata=self.agent.get_agent_metadata().hex(),
            addr=self.addr,
            nbytes=self.nbytes,
            device_id=self.device_id,
            mem_type=self.mem_type,
            transfer=transfer,
        )

    def add_peer(self, region: NixlRegion) -> str:
        """Load a peer agent's metadata; its name. PdkvError if NIXL refuses it."""
        try:
            name = self.agent.add_remote_agent(bytes.fromhex(region.metadata))
        except Exception as exc:  # NIXL raises its own error types
            raise PdkvError(f"NIXL refused the peer's agent metadata: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != region.agent:
            raise PdkvError(f"peer metadata names agent {name!r}, REGISTER says {region.agent!r}")
        return name

    def remove_peer(self, name: str) -> None:
        with contextlib.suppress(Exception):
            self.agent.remove_remote_agent(name)

    # ---- transfers (the loop's side: queue, never block) -----------------------------------------
    def transfer(self, op: str, peer: str, runs: list[Run], notif: bytes, done: Done) -> None:
        """Queue a READ (peer → us) or WRITE (us → peer) of `runs`; `done` on the loop."""
        self._submit("xfer", (op, peer, runs, notif, done))

    def new_tag(self) -> int:
        return next(self._tags)

    def expect(self, peer: str, tag: bytes, done: Done) -> None:
        """`done(None)` on the loop once notification `tag` from agent `peer` arrives."""
        self._submit("expect", ((peer, tag), done))

    def forget(self, peer: str) -> None:
        """Stop awaiting notifications from `peer` (its link ended; nobody is told)."""
        if not self._closed:
            self._submit("forget", peer)

    def _submit(self, kind: str, job: Any) -> None:
        if self._closed:
            raise NixlTransferError("the NIXL agent is closed")
        self._jobs.put((kind, job))

    def close(self) -> None:
        """Stop the worker (failing what is pending), deregister the pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(("stop", None))
        self._worker.join(timeout=10)
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self._reg)

    # ---- the worker thread -----------------------------------------------------------------------
    def _reply(self, done: Done, exc: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            self._loop.call_soon_threadsafe(done, exc)

    def _work(self) -> None:
        active: list[tuple[Any, Done]] = []
        expected: dict[tuple[str, bytes], Done] = {}
        early: dict[tuple[str, bytes], None] = {}
        idle = 0
        while True:
            busy = bool(active or expected)
            try:
                jobs = [self._jobs.get(timeout=_pause(idle)) if busy else self._jobs.get()]
                while not self._jobs.empty():  # every job queued so far, before polling
                    jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                jobs = []
            if any(kind == "stop" for kind, _ in jobs):
                self._fail_queued(jobs)
                break
            for kind, job in jobs:
                self._take(kind, job, active, expected, early)
            moved = self._poll(active) + self._notifs(expected, early)
            idle = 0 if moved or jobs else idle + 1
        stopped = NixlTransferError("the NIXL agent closed")
        for handle, done in active:
            self._release(handle)
            self._reply(done, stopped)
        for done in expected.values():
            self._reply(done, stopped)

    def _fail_queued(self, jobs: list[tuple[str, Any]]) -> None:
        """Jobs queued with the stop were never taken: their `done` still runs, once."""
        stopped = NixlTransferError("the NIXL agent closed")
        for kind, job in jobs:
            if kind in ("xfer", "expect"):
                self._reply(job[-1], stopped)

    def _take(self, kind: str, job: Any, active: list, expected: dict, early: dict) -> None:
        if kind == "xfer":
            self._post(job, active)
        elif kind == "expect":
            key, done = job
            if key in early:
                del early[key]
                self._reply(done, None)
            else:
                expected[key] = done
        elif kind == "forget":  # a link ended: its consumer failed what it awaited itself
            for key in [k for k in expected if k[0] == job]:
                del expected[key]
            for key in [k for k in early if k[0] == job]:
                del early[key]

    def _post(self, job: tuple[str, str, list[Run], bytes, Done], active: list) -> None:
        op, peer, runs, notif, done = job
        try:
            local = self.agent.get_xfer_descs(
                [(a, n, self.device_id) for a, _, n in runs], self.mem_type
            )
            remote = self.agent.get_xfer_descs(
                [(r, n, self.device_id) for _, r, n in runs], self.mem_type
            )
            handle = self.agent.initialize_xfer(op, local, remote, peer, notif)
            state = self.agent.transfer(handle)
        except Exception as exc:  # NIXL's own errors: fail this transfer only
            self._reply(done, NixlTransferError(f"NIXL {op} could not start: {exc}"))
            return
        if state == "PROC":
            active.append((handle, done))
        else:
            self._finish(handle, done, state, op)

    def _poll(self, active: list[tuple[Any, Done]]) -> int:
        finished = 0
        for item in list(active):
            handle, done = item
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception:
                state = "ERR"
            if state != "PROC":
                active.remove(item)
                self._finish(handle, done, state, "transfer")
                finished += 1
        return finished

    def _finish(self, handle: Any, done: Done, state: str, op: str) -> None:
        self._release(handle)
        err = None if state == "DONE" else NixlTransferError(f"NIXL {op} failed ({state})")
        self._reply(done, err)

    def _release(self, handle: Any) -> None:
        with contextlib.suppress(Exception):
            handle.release()

    def _notifs(
        self, expected: dict[tuple[str, bytes], Done], early: dict[tuple[str, bytes], None]
    ) -> int:
        if not expected and len(early) >= MAX_EARLY_NOTIFS:
            return 0
        try:
            notifs = self.agent.get_new_notifs()
        except Exception as exc:
            log.warning("nixl_notif_poll_failed", error=str(exc))
            return 0
        n = 0
        for peer, msgs in notifs.items():
            peer = peer.decode() if isinstance(peer, bytes) else str(peer)
            for tag in msgs:
                n += 1
                done = expected.pop((peer, tag), None)
                if done is not None:
                    self._reply(done, None)
                elif len(early) < MAX_EARLY_NOTIFS:
                    early[(peer, tag)] = None
        return n


def _pause(idle: int) -> float:
    """How long the worker waits for new jobs while transfers or notifications are due: not at
    all for the first polls, then growing to 1 ms (a transfer's own time dominates by then)."""
    if idle < 64:
        return 0.0 if idle < 16 else 0.00005
    return 0.001


__all__ = ["NIXL_MISSING", "NixlAgent", "NixlTransferError", "load_nixl", "nixl_available"]
