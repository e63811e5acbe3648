"""One NIXL agent per daemon process, over its KV pool: the engine under both NIXL transfer sides.

Contract:
- `load_nixl()` imports NIXL or raises PdkvError saying what to install (`pdkv[nixl]`).
- `NixlAgent(name, tensor)` creates an agent with the UCX backend and registers the pool's memory
  once (DRAM for a CPU tensor, VRAM for a CUDA one). `passive=True` (a prefill serving pull
  links: peers READ its memory while it posts nothing) starts NIXL's progress thread, which
  spins a core whenever the agent exists (NIXL's Python API gives it no delay: 100 % of a core
  per idle daemon, measured on the CPU VM); otherwise there is none, and the agent's worker
  drives UCX's progress itself while a transfer or a notification is due: the side that posts
  a WRITE or READ, and the decode awaiting a push's notification (whose bytes land while it
  polls). `region(transfer)` is its wire form
  (`common.protocol.NixlRegion`: agent name, metadata, address, length, device, memory type).
- `add_peer(region)` loads a peer's metadata and returns its agent name; `remove_peer(name)`
  says one link no longer uses it. Peers are counted per link (a prefill that reconnects adds
  the same agent before its old link is torn down) and forgotten when no link uses them, and
  then only once no transfer to them is in flight.
- `transfer(op, peer, runs, notif, done)` queues one NIXL READ or WRITE of byte runs
  `[(local_addr, remote_addr, nbytes)]`; `expect(peer, tag, done)` waits for notification `tag`
  from agent `peer`. `new_tag()` numbers transfers once per agent (never reused, so a late
  notification of a link that ended cannot complete another link's transfer). Both call
  `done(None)` or `done(exc)` exactly once, on the event loop given at construction, and a
  transfer's once NIXL reports it DONE or ERR: nothing it moves lands after that.
- `cancel(peer)` aborts the transfers to `peer` with NIXL's release (each one's `done` gets
  NixlTransferCancelled once NIXL took it back; a release is not a fence: see nixl_worker);
  `in_flight(peer)` counts the transfers whose `done` has not run.
- `forget(peer)` drops what is awaited from `peer`; `close()` (idempotent) stops the worker,
  releases what is still in flight, fails what is awaited and deregisters the memory.

Nothing here blocks the loop: NIXL calls other than registration and loading a peer run on the
agent's worker thread (common.transfer.nixl_worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from typing import Any

import structlog
import torch

from common.errors import PdkvError
from common.protocol import NixlRegion
from common.transfer.nixl_worker import (
    Done,
    NixlTransferCancelled,
    NixlTransferError,
    NixlWorker,
    Peers,
    Run,
)

log = structlog.get_logger(__name__)

NIXL_MISSING = (
    "NIXL is not installed, and a link across hosts (tcp://) moves the KV with it: "
    "pip install 'pdkv[nixl]'"
)
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


class NixlAgent:
    def __init__(
        self,
        role: str,
        tensor: torch.Tensor,
        loop: asyncio.AbstractEventLoop,
        *,
        passive: bool = False,
    ) -> None:
        api = load_nixl()
        self.name = f"pdkv-{role}-{os.getpid()}-{next(_names)}-{os.urandom(4).hex()}"
        self.mem_type = "VRAM" if tensor.device.type == "cuda" else "DRAM"
        self.device_id = tensor.device.index or 0
        self.addr = tensor.data_ptr()
        self.nbytes = tensor.numel() * tensor.element_size()
        self._tensor = tensor  # the registration must not outlive the memory
        conf = api.nixl_agent_config(
            enable_prog_thread=passive,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.agent = api.nixl_agent(self.name, conf)
        self._reg = self.agent.register_memory(
            [(self.addr, self.nbytes, self.device_id, "")], self.mem_type
        )
        self._tags = itertools.count(1)
        self._busy: dict[str, int] = {}  # peer -> transfers whose `done` has not run
        self._closed = False
        self._peers = Peers(self.agent)
        self._worker = NixlWorker(
            self.agent, self.mem_type, self.device_id, self._peers, loop, f"nixl-{role}"
        )

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

    # ---- peers -----------------------------------------------------------------------------------
    def add_peer(self, region: NixlRegion) -> str:
        """Load a peer agent's metadata for one more link; its name. PdkvError if refused."""
        return self._peers.add(region.agent, region.metadata)

    def remove_peer(self, name: str) -> None:
        """One link less uses `name`: forgotten when none does and no transfer to it is in
        flight (never under a transfer: NIXL would fail it while its bytes may still move)."""
        if self._peers.unref(name) and not self._closed:
            self._worker.submit("drop", name)

    # ---- transfers (the loop's side: queue, never block) -----------------------------------------
    def transfer(self, op: str, peer: str, runs: list[Run], notif: bytes, done: Done) -> None:
        """Queue a READ (peer → us) or WRITE (us → peer) of `runs`; `done` on the loop once the
        transfer is over."""
        self._check_open()
        self._busy[peer] = self._busy.get(peer, 0) + 1

        def over(exc: BaseException | None) -> None:  # on the loop
            left = self._busy.get(peer, 1) - 1
            if left:
                self._busy[peer] = left
            else:
                self._busy.pop(peer, None)
            done(exc)

        self._worker.submit("xfer", (op, peer, runs, notif, over))

    def in_flight(self, peer: str) -> int:
        """Transfers to or from `peer` whose `done` has not run."""
        return self._busy.get(peer, 0)

    def cancel(self, peer: str) -> None:
        """Abort every transfer to or from `peer`; each `done` gets NixlTransferCancelled once
        NIXL released it (one it cannot release yet stays in flight until it can)."""
        if not self._closed:
            self._worker.submit("cancel", peer)

    def new_tag(self) -> int:
        return next(self._tags)

    def expect(self, peer: str, tag: bytes, done: Done) -> None:
        """`done(None)` on the loop once notification `tag` from agent `peer` arrives."""
        self._check_open()
        self._worker.submit("expect", ((peer, tag), done))

    def hurry(self) -> None:
        """Something awaited is about to arrive (a push's KV_READY came): the worker polls at
        once and closely again, not at the 1 ms it backs off to while a wait drags on."""
        if not self._closed:
            self._worker.submit("hurry", None)

    def forget(self, peer: str, tags: list[bytes]) -> None:
        """Stop awaiting notifications `tags` from `peer` (their link ended; nobody is told).
        By tag, not by peer: a prefill that reconnected awaits others from the same agent."""
        if tags and not self._closed:
            self._worker.submit("forget", (peer, list(tags)))

    def _check_open(self) -> None:
        if self._closed:
            raise NixlTransferError("the NIXL agent is closed")

    def close(self) -> None:
        """Stop the worker (releasing and failing what is pending), deregister the pool.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._worker.stop()
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self._reg)


__all__ = [
    "NIXL_MISSING",
    "NixlAgent",
    "NixlTransferCancelled",
    "NixlTransferError",
    "load_nixl",
    "nixl_available",
]
