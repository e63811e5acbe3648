"""The NIXL agent's worker thread and its table of peers: every NIXL call that may wait runs here.

`NixlWorker` takes jobs from the loop (`submit`) and, while anything is due, polls: it posts
transfers, polls their state and the notifications, and hands every completion to the loop with
`call_soon_threadsafe`. It sleeps on its queue when nothing is due and backs off to 1 ms polls
while transfers or notifications are pending; any job (`hurry` is one that does nothing else)
starts the close polls again, so a notification the loop knows to be near (a push's KV_READY
came) is seen within ~50 µs rather than up to 1 ms late.

A transfer's `done` is called once NIXL reports it DONE or ERR, or once its handle was released
(`cancel(peer)`, NIXL's abort, or the agent closing); a release that NIXL refuses leaves the
transfer in flight, polled and released again until NIXL takes it. A release is not a fence:
under UCX's TCP transport a released WRITE or READ still delivered the bytes it had posted once
the stalled peer ran again (measured), so only DONE/ERR says that nothing more lands. A peer
whose metadata is to go (`drop`) is removed only once no transfer to it is in flight: removing
it under a transfer makes NIXL fail the transfer while its bytes may still move.

`Peers` counts the links that use each peer agent (a prefill that reconnects loads the same
agent again before the old link is torn down); the loop adds, the worker removes, one lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

import structlog

from common.errors import PdkvError

log = structlog.get_logger(__name__)
Done = Callable[[BaseException | None], None]
Run = tuple[int, int, int]  # (local address, remote address, bytes)
#: Notifications that arrive before anyone awaits them are kept, up to this many.
MAX_EARLY_NOTIFS = 4096


class NixlTransferError(PdkvError):
    """A NIXL transfer failed or could not be posted; fails that request only."""


class NixlTransferCancelled(NixlTransferError):
    """A transfer released before it completed (its link ended)."""


class Peers:
    """Peer agents loaded into one NIXL agent, counted by the links that use them."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        self._refs: dict[str, int] = {}
        self._loaded: dict[str, str] = {}  # name -> the metadata it was loaded from

    def add(self, name: str, metadata: str) -> str:
        """Load `metadata` of agent `name` (once while a link uses it); PdkvError if refused."""
        with self._lock:
            known = self._loaded.get(name)
            if known is None:
                self._load(name, metadata)
            elif known != metadata:
                raise PdkvError(f"agent {name!r} is loaded already, with other metadata")
            self._refs[name] = self._refs.get(name, 0) + 1
        return name

    def _load(self, name: str, metadata: str) -> None:
        try:
            got = self._agent.add_remote_agent(bytes.fromhex(metadata))
        except Exception as exc:  # NIXL raises its own error types
            raise PdkvError(f"NIXL refused the peer's agent metadata: {exc}") from exc
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != name:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(got)
            raise PdkvError(f"peer metadata names agent {got!r}, REGISTER says {name!r}")
        self._loaded[name] = metadata

    def unref(self, name: str) -> bool:
        """One link less uses `name`; True when none does any more."""
        with self._lock:
            left = self._refs.get(name, 0) - 1
            if left > 0:
                self._refs[name] = left
                return False
            self._refs.pop(name, None)
            return name in self._loaded

    def remove_unused(self, name: str) -> None:
        """Forget agent `name` unless a link took it again meanwhile (worker thread)."""
        with self._lock:
            if self._refs.get(name, 0) == 0 and self._loaded.pop(name, None) is not None:
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)


class NixlWorker:
    """The thread behind one NixlAgent (module docstring). Jobs: ("xfer", (op, peer, runs,
    notif, done)), ("expect", ((peer, tag), done)), ("forget", (peer, tags)), ("cancel", peer),
    ("drop", peer), ("stop", None)."""

    def __init__(
        self,
        agent: Any,
        mem_type: str,
        device_id: int,
        peers: Peers,
        loop: asyncio.AbstractEventLoop,
        name: str,
    ) -> None:
        self.agent = agent
        self.mem_type = mem_type
        self.device_id = device_id
        self.peers = peers
        self._loop = loop
        self._jobs: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._active: list[tuple[Any, Done, str]] = []  # posted: (handle, done, peer)
        self._stuck: list[tuple[Any, Done, str]] = []  # cancelled, release refused so far
        self._expected: dict[tuple[str, bytes], Done] = {}
        self._early: dict[tuple[str, bytes], None] = {}
        self._leaving: set[str] = set()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, kind: str, job: Any) -> None:
        self._jobs.put((kind, job))

    def stop(self, timeout: float = 10.0) -> None:
        self._jobs.put(("stop", None))
        self._thread.join(timeout)

    def _reply(self, done: Done, exc: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            self._loop.call_soon_threadsafe(done, exc)

    # ---- the loop of the thread ------------------------------------------------------------------
    def _work(self) -> None:
        idle = 0
        while True:
            busy = bool(self._active or self._stuck or self._expected or self._leaving)
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
                self._take(kind, job)
            moved = self._poll() + self._notifs() + self._unstick()
            self._drop_unused()
            idle = 0 if moved or jobs else idle + 1
        self._shut()

    def _take(self, kind: str, job: Any) -> None:
        if kind == "xfer":
            self._post(job)
        elif kind == "expect":
            key, done = job
            if key in self._early:
                del self._early[key]
                self._reply(done, None)
            else:
                self._expected[key] = done
        elif kind == "forget":  # a link ended: its consumer failed these awaited pushes itself
            peer, tags = job
            for tag in tags:
                self._expected.pop((peer, tag), None)
                self._early.pop((peer, tag), None)
        elif kind == "cancel":
            for item in [a for a in self._active if a[2] == job]:
                self._active.remove(item)
                self._stuck.append(item)
            self._unstick()
        elif kind == "drop":
            self._leaving.add(job)
        # "hurry": nothing to take; being a job, it resets the backoff (`_work`)

    def _post(self, job: tuple[str, str, list[Run], bytes, Done]) -> None:
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
            self._active.append((handle, done, peer))
        else:
            self._finish(handle, done, state, op)

    def _poll(self) -> int:
        finished = 0
        for item in list(self._active):
            handle, done, _ = item
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception:
                state = "ERR"
            if state != "PROC":
                self._active.remove(item)
                self._finish(handle, done, state, "transfer")
                finished += 1
        return finished

    def _finish(self, handle: Any, done: Done, state: str, op: str) -> None:
        with contextlib.suppress(Exception):
            handle.release()
        err = None if state == "DONE" else NixlTransferError(f"NIXL {op} failed ({state})")
        self._reply(done, err)

    def _unstick(self) -> int:
        """Release every cancelled transfer NIXL lets go of; each one's `done` says so."""
        released = 0
        for item in list(self._stuck):
            handle, done, peer = item
            try:
                handle.release()
            except Exception as exc:  # still moving: released again at the next poll
                log.warning("nixl_release_refused", peer=peer, error=str(exc))
                continue
            self._stuck.remove(item)
            self._reply(done, NixlTransferCancelled(f"transfer to {peer} cancelled"))
            released += 1
        return released

    def _drop_unused(self) -> None:
        for name in list(self._leaving):
            if not any(p == name for _, _, p in self._active + self._stuck):
                self._leaving.discard(name)
                self.peers.remove_unused(name)

    def _notifs(self) -> int:
        if not self._expected and len(self._early) >= MAX_EARLY_NOTIFS:
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
                done = self._expected.pop((peer, tag), None)
                if done is not None:
                    self._reply(done, None)
                elif len(self._early) < MAX_EARLY_NOTIFS:
                    self._early[(peer, tag)] = None
        return n

    # ---- stop ------------------------------------------------------------------------------------
    def _fail_queued(self, jobs: list[tuple[str, Any]]) -> None:
        """Jobs queued with the stop were never taken: their `done` still runs, once."""
        stopped = NixlTransferError("the NIXL agent closed")
        for kind, job in jobs:
            if kind in ("xfer", "expect"):
                self._reply(job[-1], stopped)

    def _shut(self) -> None:
        stopped = NixlTransferCancelled("the NIXL agent closed")
        for handle, done, _ in self._active + self._stuck:
            with contextlib.suppress(Exception):
                handle.release()
            self._reply(done, stopped)
        for done in self._expected.values():
            self._reply(done, NixlTransferError("the NIXL agent closed"))


def _pause(idle: int) -> float:
    """How long the worker waits for new jobs while transfers or notifications are due: not at
    all for the first polls, then growing to 1 ms (a transfer's own time dominates by then)."""
    if idle < 64:
        return 0.0 if idle < 16 else 0.00005
    return 0.001


__all__ = [
    "MAX_EARLY_NOTIFS",
    "Done",
    "NixlTransferCancelled",
    "NixlTransferError",
    "NixlWorker",
    "Peers",
    "Run",
]
