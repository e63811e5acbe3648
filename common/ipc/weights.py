"""One copy of a model's weights per host: the arena (common.model.arena) of whichever daemon
loaded it first, mapped by the others (docs/architecture.md, "One copy of the weights per host").

Rendezvous, in the runtime dir, per `WeightsKey` (model fingerprint, dtype, device) and arena
layout (its digest; together the TAG): `weights-TAG.lock` (flock, held while a daemon looks for
the arena or loads it) and `w-TAG.sock`, served by the owner from a thread. A connection gets one
offer (a 4-byte big-endian length, at most MAX_OFFER, then JSON; on CPU the memfd rides on its
first byte with SCM_RIGHTS) and is then kept open: its EOF tells the importer that the owner is gone.

Owner gone: an fd-backed arena (a memfd on CPU, a VMM allocation on CUDA: common.ipc.vmm) lives
while any process maps it, so the importer serves on and takes the ownership over (the same fd on
the socket). Through legacy CUDA IPC (the pool's backends, where VMM is unavailable) an imported
pointer is valid only while its exporter holds the allocation and cannot be exported again, so
the importer calls `on_lost` (the daemons': log and exit at once).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from common.errors import CudaError, IpcError
from common.ipc import vmm
from common.ipc.backends import backend_for
from common.ipc.base import RegionDescriptor, SharedRegion
from common.ipc.fdpass import send_with_fds
from common.ipc.weights_offer import (
    OFFER_VERSION,
    SIZE,
    Offer,
    ask,
    flat,
    map_readonly,
    offer_frame,
)
from common.model.arena import WeightsLayout

log = structlog.get_logger(__name__)
#: arenas whose fd travels with the offer: any holder can serve them on (see the module doc)
FD_KINDS = frozenset({"shm", vmm.KIND})


@dataclass(frozen=True)
class WeightsKey:
    """What makes two daemons' weights the same bytes: the model's fingerprint, the dtype, the
    device (`cpu`, or the GPU's UUID: another GPU of the host gets its own copy) and the files
    they are read from."""

    fingerprint: str
    dtype: str
    device: str
    files: str = ""  # the files read (ModelSource.files_id): a copy of them is another model

    @property
    def digest(self) -> str:
        blob = f"{self.fingerprint}\0{self.dtype}\0{self.device}\0{self.files}".encode()
        return hashlib.sha256(blob).hexdigest()[:20]


@dataclass
class SharedWeights:
    """This process's hold on a shared arena, as its owner or an importer of it. `close` (once
    nothing reads `arena` any more) stops serving it or lets go of the mapping."""

    key: WeightsKey
    arena: torch.Tensor
    _share: _Share

    @property
    def role(self) -> str:
        """ "owner" or "importer" (an importer on CPU becomes the owner when its owner goes)."""
        return self._share.role

    @property
    def owner_pid(self) -> int:
        return self._share.owner_pid

    def close(self) -> None:
        self._share.close()


def acquire(
    runtime_dir: Path,
    key: WeightsKey,
    layout: WeightsLayout,
    device: torch.device,
    backend: str,
    load: Callable[[torch.Tensor], None],
    *,
    on_lost: Callable[[int], None],
) -> SharedWeights:
    """The arena of `key`: mapped from the daemon that serves it, or else allocated here,
    filled by `load(arena)` and served from now on. `on_lost(owner_pid)` runs (on a thread)
    when the owner of an arena shared by legacy CUDA IPC goes away (see the module doc)."""
    share = _Share(runtime_dir, key, layout, device, arena_kind(device, backend), on_lost)
    with share.locked():
        if not share.join():
            share.create(load)
    assert share.arena is not None
    return SharedWeights(key, share.arena, share)


def arena_kind(device: torch.device, backend: str) -> str:
    """How an arena on `device` is shared: `shm` (a memfd) on CPU; on CUDA `cuda-vmm` (an fd
    that outlives its exporter) where the extension and driver have it, else the pool's
    `backend` (legacy CUDA IPC: valid only while its exporter lives)."""
    if device.type == "cpu":
        return "shm"
    return vmm.KIND if vmm.usable(device.index or 0) else backend


def rendezvous(
    runtime_dir: Path, key: WeightsKey, layout: WeightsLayout, kind: str
) -> tuple[Path, Path]:
    """(lock file, socket) of `key`'s arena of `layout` shared as `kind` in `runtime_dir`. The
    layout and kind are in the name too: daemons whose arenas differ never meet."""
    tag = hashlib.sha256(f"{key.digest}/{layout.digest()}/{kind}".encode()).hexdigest()[:12]
    return runtime_dir / f"weights-{tag}.lock", runtime_dir / f"w-{tag}.sock"  # AF_UNIX: short


class _Share:
    def __init__(
        self,
        runtime_dir: Path,
        key: WeightsKey,
        layout: WeightsLayout,
        device: torch.device,
        kind: str,
        on_lost: Callable[[int], None],
    ) -> None:
        self.lock_path, self.sock_path = rendezvous(runtime_dir, key, layout, kind)
        self.key, self.layout, self.device = key, layout, device
        self.kind, self.on_lost = kind, on_lost
        self.arena: torch.Tensor | None = None
        # the export (shm and legacy owners) or the import (legacy importers) of the arena
        self.region: SharedRegion | None = None
        # an fd-backed arena (shm importers, cuda-vmm): its fd and descriptor, to serve it on
        self.fd = -1
        self.desc: RegionDescriptor | None = None
        self.private = False  # an offer could not be mapped: load a copy of our own, unserved
        self.role, self.owner_pid = "", 0
        self.listener: socket.socket | None = None
        self.peers: list[socket.socket] = []
        self.watched: socket.socket | None = None
        self.closing = False

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a load in progress elsewhere: wait for its arena
                log.info("weights_waiting", lock=str(self.lock_path))
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    # ---- importer ------------------------------------------------------------------------------
    def _check(self, offer: Offer, fds: list[int]) -> None:
        region = offer.region
        region.check()
        if (
            offer.version != OFFER_VERSION
            or offer.key != self.key.digest
            or offer.layout != self.layout.digest()
            or region.nbytes != self.layout.nbytes
            or region.kind != self.kind
        ):
            raise IpcError(
                f"the weights served on {self.sock_path} (pid {offer.owner_pid}) are not this "
                f"model's ({offer.key}/{offer.layout}/{region.kind} ≠ {self.key.digest}/"
                f"{self.layout.digest()}/{self.kind}): stop that daemon, or start this one "
                "with --no-share-weights"
            )
        if len(fds) != (1 if region.kind in FD_KINDS else 0):
            raise IpcError(f"weights offer of kind {region.kind} came with {len(fds)} fds")

    def join(self) -> bool:
        """Map the arena someone serves; False when nobody does."""
        asked = ask(self.sock_path)
        if asked is None:
            return False
        offer, fds, sock = asked
        try:
            self._check(offer, fds)
            self.arena = self._map(offer.region, fds)
        except CudaError as exc:  # this GPU cannot map it: a copy of our own, not served
            log.warning("weights_map_failed", error=str(exc), owner_pid=offer.owner_pid)
            for fd in fds:
                os.close(fd)
            sock.close()
            self.private = True
            return False
        except BaseException:
            for fd in fds:
                os.close(fd)
            sock.close()
            raise
        self.role, self.owner_pid = "importer", offer.owner_pid
        self._watch(sock)
        log.info("weights_mapped", key=self.key.digest, owner_pid=offer.owner_pid)
        return True

    def _map(self, desc: RegionDescriptor, fds: list[int]) -> torch.Tensor:
        """The offered arena, mapped read-only where the kind allows; an fd is kept."""
        if desc.kind == "shm":
            arena = map_readonly(fds[0], desc)
        elif desc.kind == vmm.KIND:
            (size,) = SIZE.unpack(desc.handle)
            arena = vmm.vmm_open(fds[0], size, desc.nbytes, self.device)
        else:
            self.region = backend_for(desc.kind).open_for(desc, [], self.device)
            return self.region.to_tensor()
        self.fd, self.desc = fds.pop(), desc
        return arena

    def _watch(self, sock: socket.socket) -> None:
        self.watched = sock
        threading.Thread(
            target=self._owner_watch, args=(sock,), name="pdkv-weights-watch", daemon=True
        ).start()

    def _owner_watch(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while sock.recv(64):
                pass
        sock.close()
        if self.closing:
            return
        log.warning("weights_owner_gone", owner_pid=self.owner_pid, key=self.key.digest)
        if self.fd < 0:  # legacy CUDA IPC: the mapping may be gone with its exporter
            self.on_lost(self.owner_pid)
            return
        try:
            self._take_over()
        except Exception:  # the mapping stays valid: serve on, only unshared
            log.exception("weights_take_over_failed", key=self.key.digest)

    def _take_over(self) -> None:
        """An fd-backed arena: someone else serves it now (watch them), or we do."""
        with self.locked():
            if self.closing:
                return
            asked = ask(self.sock_path)
            if asked is not None:
                offer, fds, sock = asked
                for fd in fds:
                    os.close(fd)
                self.owner_pid = offer.owner_pid
                self._watch(sock)
                return
            self.role, self.owner_pid = "owner", os.getpid()
            assert self.desc is not None
            self._serve(self.desc, [self.fd])
        log.info("weights_owner_taken_over", key=self.key.digest)

    # ---- owner ---------------------------------------------------------------------------------
    def create(self, load: Callable[[torch.Tensor], None]) -> None:
        """Load the weights into a new arena and serve it (unless `private`)."""
        self.role, self.owner_pid = "owner", os.getpid()
        arena = None if self.private else self._new_arena()
        if arena is None:  # a copy of our own, served to nobody
            self.arena = self.layout.allocate(self.device)
            load(self.arena)
            return
        load(arena)
        if arena.is_cuda:  # the copies are done before anyone can map the arena
            torch.cuda.synchronize(arena.device)
        if self.kind != vmm.KIND:
            self.region = backend_for(self.kind).export(arena)
            self.desc = self.region.desc
        assert self.desc is not None
        self.arena = arena
        fds = [self.fd] if self.fd >= 0 else self.region.fds()  # type: ignore[union-attr]
        try:
            self._serve(self.desc, fds)
        except OSError as exc:  # e.g. a runtime dir whose path is too long for a socket
            log.warning("weights_not_shared", error=str(exc), socket=str(self.sock_path))
            return
        log.info("weights_shared", key=self.key.digest, kind=self.kind, nbytes=self.layout.nbytes)

    def _new_arena(self) -> torch.Tensor | None:
        """An empty arena that can be shared as `kind`; None if a VMM allocation fails."""
        if self.kind != vmm.KIND:
            return self.layout.allocate(self.device, shared=True)
        try:
            arena, self.fd, size = vmm.vmm_empty(self.layout.nbytes, self.device)
        except CudaError as exc:
            log.warning("weights_not_shared", error=str(exc), kind=self.kind)
            return None
        self.desc = flat(self.kind, self.layout.nbytes, SIZE.pack(size), self.key.device)
        return arena

    def _serve(self, desc: RegionDescriptor, fds: list[int]) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.sock_path.unlink()  # a dead owner's: under the lock, nobody serves it
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(str(self.sock_path))
            os.chmod(self.sock_path, 0o600)
            listener.listen(16)
        except OSError:
            listener.close()
            raise
        self.listener = listener
        offer = Offer(
            version=OFFER_VERSION,
            key=self.key.digest,
            layout=self.layout.digest(),
            owner_pid=os.getpid(),
            region=desc,
        )
        threading.Thread(
            target=self._accept,
            args=(listener, offer_frame(offer), fds),
            name="pdkv-weights-serve",
            daemon=True,
        ).start()

    def _accept(self, listener: socket.socket, frame: bytes, fds: list[int]) -> None:
        from common.wire.channel import peer_credentials

        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: stopping
            try:
                pid, uid, _ = peer_credentials(conn)
                if uid != os.getuid():
                    log.warning("weights_peer_refused", peer_pid=pid, peer_uid=uid)
                    conn.close()
                    continue
                send_with_fds(conn, frame, fds)
            except OSError as exc:
                log.warning("weights_offer_failed", error=str(exc))
                conn.close()
                continue
            self.peers = [p for p in self.peers if _open(p)]  # importers that went away
            self.peers.append(conn)  # held open: its EOF tells the importer we are gone
            log.info("weights_offered", peer_pid=pid, key=self.key.digest)

    def close(self) -> None:
        """Idempotent. The owner stops serving (its importers see EOF); an importer lets go."""
        if self.closing:
            return
        self.closing = True
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
            self.listener.close()
            with contextlib.suppress(OSError):
                self.sock_path.unlink()
        for conn in [*self.peers, *([self.watched] if self.watched else [])]:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self.arena = None
        if self.region is not None:
            self.region.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open(sock: socket.socket) -> bool:
    """False (and closed) once the peer has closed its end."""
    try:
        if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b"":
            return True
    except BlockingIOError:
        return True
    except OSError:
        pass
    sock.close()
    return False


__all__ = ["FD_KINDS", "SharedWeights", "WeightsKey", "acquire", "arena_kind", "rendezvous"]
