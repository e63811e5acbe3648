"""One copy of a model's weights per host: the arena (common.model.arena) of whichever daemon
loaded it first, mapped by the others (docs/architecture.md, "One copy of the weights per host").

Rendezvous, in the runtime dir, per `WeightsKey` (model fingerprint, dtype, device) and arena
layout (its digest; together the TAG): `weights-TAG.lock` (flock, held while a daemon looks for
the arena or loads it) and `w-TAG.sock`, served by the owner from a thread. A connection gets one
offer (a 4-byte big-endian length, at most MAX_OFFER, then JSON; on CPU the memfd rides on its
first byte with SCM_RIGHTS) and is then kept open: its EOF tells the importer that the owner is gone.

Owner gone: on CPU the importer's read-only mapping keeps the pages, so it serves on and takes
the ownership over (the same memfd on the socket). On CUDA an imported IPC pointer is valid only
while its exporter holds the allocation and cannot be exported again, so the importer calls
`on_lost` (the daemons': log and exit at once).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import socket
import struct
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog
import torch

from common.errors import IpcError
from common.ipc.backends import backend_for
from common.ipc.base import RegionDescriptor, SharedRegion
from common.ipc.fdpass import recv_exact_with_fds, send_with_fds
from common.model.arena import WeightsLayout

log = structlog.get_logger(__name__)
MAX_OFFER = 64 * 1024
OFFER_VERSION = 1
_LEN = struct.Struct(">I")


@dataclass(frozen=True)
class WeightsKey:
    """What makes two daemons' weights the same bytes: the model's fingerprint, the dtype, and
    the device (`cpu`, or the GPU's UUID: another GPU of the host gets its own copy)."""

    fingerprint: str
    dtype: str
    device: str

    @property
    def digest(self) -> str:
        blob = f"{self.fingerprint}\0{self.dtype}\0{self.device}".encode()
        return hashlib.sha256(blob).hexdigest()[:20]


class Offer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Owner → importer, once per connection of the weights socket."""

    version: int
    key: str
    layout: str  # WeightsLayout.digest()
    owner_pid: int
    region: RegionDescriptor


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
    when a CUDA importer's owner goes away."""
    share = _Share(runtime_dir, key, layout, device, backend, on_lost)
    with share.locked():
        if not share.join():
            share.create(load)
    assert share.arena is not None
    return SharedWeights(key, share.arena, share)


def rendezvous(runtime_dir: Path, key: WeightsKey, layout: WeightsLayout) -> tuple[Path, Path]:
    """(lock file, socket) of `key`'s arena of `layout` in `runtime_dir`. The layout is in the
    name too: daemons whose arenas differ (another pdkv version) never meet."""
    tag = hashlib.sha256(f"{key.digest}/{layout.digest()}".encode()).hexdigest()[:12]
    return runtime_dir / f"weights-{tag}.lock", runtime_dir / f"w-{tag}.sock"  # AF_UNIX: short


class _Share:
    def __init__(
        self,
        runtime_dir: Path,
        key: WeightsKey,
        layout: WeightsLayout,
        device: torch.device,
        backend: str,
        on_lost: Callable[[int], None],
    ) -> None:
        self.lock_path, self.sock_path = rendezvous(runtime_dir, key, layout)
        self.key, self.layout, self.device = key, layout, device
        self.backend, self.on_lost = backend, on_lost
        self.arena: torch.Tensor | None = None
        self.region: SharedRegion | None = None  # owner: the export; CUDA importer: the import
        self.memfd = -1  # CPU importer: the memfd, kept to serve it if the owner goes
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
    def _ask(self) -> tuple[Offer, list[int], socket.socket] | None:
        """The offer of whoever serves the socket, or None when nobody does."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(30)
        try:
            sock.connect(str(self.sock_path))
        except OSError:  # no socket file, or a dead owner's (ECONNREFUSED)
            sock.close()
            return None
        try:
            head, fds = recv_exact_with_fds(sock, _LEN.size, 1)
            (size,) = _LEN.unpack(head)
            if size > MAX_OFFER:
                raise IpcError(f"weights offer of {size} bytes (limit {MAX_OFFER})")
            body, more = recv_exact_with_fds(sock, size, 0) if size else (b"", [])
            offer = msgspec.json.decode(body, type=Offer)
        except (OSError, IpcError, msgspec.DecodeError) as exc:
            sock.close()
            raise IpcError(f"bad weights offer on {self.sock_path}: {exc}") from exc
        sock.settimeout(None)
        return offer, fds + more, sock

    def _check(self, offer: Offer, fds: list[int]) -> None:
        region = offer.region
        region.check()
        if (
            offer.version != OFFER_VERSION
            or offer.key != self.key.digest
            or offer.layout != self.layout.digest()
            or region.nbytes != self.layout.nbytes
            or region.kind != self.backend
        ):
            raise IpcError(
                f"the weights served on {self.sock_path} (pid {offer.owner_pid}) are not this "
                f"model's ({offer.key}/{offer.layout}/{region.kind} ≠ {self.key.digest}/"
                f"{self.layout.digest()}/{self.backend}): stop that daemon, or start this one "
                "with --no-share-weights"
            )
        if len(fds) != (1 if region.kind == "shm" else 0):
            raise IpcError(f"weights offer of kind {region.kind} came with {len(fds)} fds")

    def join(self) -> bool:
        """Map the arena someone serves; False when nobody does."""
        asked = self._ask()
        if asked is None:
            return False
        offer, fds, sock = asked
        try:
            self._check(offer, fds)
            if offer.region.kind == "shm":
                self.memfd = fds.pop()
                self.arena = _map_readonly(self.memfd, offer.region)
            else:
                cls = backend_for(offer.region.kind)
                self.region = cls.open_for(offer.region, [], self.device)
                self.arena = self.region.to_tensor()
        except BaseException:
            for fd in fds:
                os.close(fd)
            sock.close()
            raise
        self.role, self.owner_pid = "importer", offer.owner_pid
        self._watch(sock)
        log.info("weights_mapped", key=self.key.digest, owner_pid=offer.owner_pid)
        return True

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
        if self.memfd < 0:  # CUDA: the mapping may be gone with its exporter
            self.on_lost(self.owner_pid)
            return
        try:
            self._take_over()
        except Exception:  # the mapping stays valid: serve on, only unshared
            log.exception("weights_take_over_failed", key=self.key.digest)

    def _take_over(self) -> None:
        """CPU: someone else serves the same arena now (watch them), or we do."""
        with self.locked():
            if self.closing:
                return
            asked = self._ask()
            if asked is not None:
                offer, fds, sock = asked
                for fd in fds:
                    os.close(fd)
                self.owner_pid = offer.owner_pid
                self._watch(sock)
                return
            self.role, self.owner_pid = "owner", os.getpid()
            self._serve(_readonly_descriptor(self.layout.nbytes), [self.memfd])
        log.info("weights_owner_taken_over", key=self.key.digest)

    # ---- owner ---------------------------------------------------------------------------------
    def create(self, load: Callable[[torch.Tensor], None]) -> None:
        """Load the weights into a new arena and serve it."""
        arena = self.layout.allocate(self.device, shared=True)
        load(arena)
        if arena.is_cuda:  # the copies are done before anyone can map the arena
            torch.cuda.synchronize(arena.device)
        self.region = backend_for(self.backend).export(arena)
        self.arena, self.role, self.owner_pid = arena, "owner", os.getpid()
        try:
            self._serve(self.region.desc, self.region.fds())
        except OSError as exc:  # e.g. a runtime dir whose path is too long for a socket
            log.warning("weights_not_shared", error=str(exc), socket=str(self.sock_path))
            return
        log.info("weights_shared", key=self.key.digest, nbytes=self.layout.nbytes)

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
        body = msgspec.json.encode(offer)
        threading.Thread(
            target=self._accept,
            args=(listener, _LEN.pack(len(body)) + body, fds),
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
        if self.memfd >= 0:
            os.close(self.memfd)
            self.memfd = -1


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


def _readonly_descriptor(nbytes: int) -> RegionDescriptor:
    return RegionDescriptor(
        kind="shm",
        handle=b"",
        offset=0,
        nbytes=nbytes,
        dtype="uint8",
        shape=(nbytes,),
        strides=(1,),
    )


def _map_readonly(fd: int, desc: RegionDescriptor) -> torch.Tensor:
    """desc's bytes of memfd `fd`, mapped read-only: a write to them faults in this process
    instead of changing the owner's model. The fd stays open (the caller's)."""
    from common.ipc.shm import _check_sealed

    _check_sealed(fd)
    size = os.fstat(fd).st_size
    if size < desc.offset + desc.nbytes:
        raise IpcError(f"weights memfd holds {size} bytes, the offer needs {desc.nbytes}")
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    with warnings.catch_warnings():  # torch warns that the buffer is not writable: on purpose
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(mm, dtype=torch.uint8)
    return raw[desc.offset : desc.offset + desc.nbytes]


__all__ = ["MAX_OFFER", "Offer", "SharedWeights", "WeightsKey", "acquire", "rendezvous"]
