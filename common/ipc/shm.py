"""The `shm` backend: CPU tensors in a memfd, shared by passing the fd with SCM_RIGHTS.

Exporter: allocate the pool with `shm_empty` (or `KVPool.create`), then `ShmRegion.export(t)`;
send `region.desc` and `region.fds()` to the peer (see common.ipc.fdpass). Importer:
`ShmRegion.open(desc, fds)` maps the same pages; `to_tensor()` views them as desc's dtype/shape.

Lifetimes:
- `shm_empty` maps a new memfd; every tensor over it holds the mmap (torch.frombuffer keeps a
  buffer export), so the pages live exactly as long as some tensor does. A process-wide registry
  of mapped ranges (holding the mmap weakly) lets `export` find the memfd and byte offset of any
  tensor or interior view; the memfd is closed when the mmap is collected.
- `open` takes ownership of the received fds: it closes them on failure and right after mapping
  on success (mmap holds its own duplicate), so no fd outlives the mapping.
- Rule: drop every tensor from `to_tensor()` before `close()`. If some are still alive, close()
  logs `shm_close_deferred` and leaves the mapping to be unmapped when the last one is collected;
  it never unmaps pages a live tensor points at, and never raises. (torch.frombuffer keeps a
  reference to the mmap object but no buffer export, so mmap.close() is never called: it would
  succeed and leave the tensors pointing at unmapped pages.)
"""

from __future__ import annotations

import bisect
import fcntl
import math
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from typing import ClassVar

import structlog
import torch

from common.errors import IpcError
from common.ipc.base import (
    RegionDescriptor,
    SharedRegion,
    as_contiguous_view,
    bytes_as,
    describe,
    dtype_from_name,
    dtype_name,
    register_backend,
)

log = structlog.get_logger(__name__)

_ALLOC_HINT = "allocate it with common.ipc.shm.shm_empty() or common.kv.pool.KVPool.create()"


class _Mapping:
    """One memfd mapped in this process: [base, base + size) of address space."""

    __slots__ = ("base", "fd", "mm", "size")

    def __init__(self, base: int, size: int, mm: mmap.mmap, fd: int) -> None:
        self.base, self.size, self.fd = base, size, fd
        self.mm = weakref.ref(mm)


_lock = threading.Lock()
_bases: list[int] = []  # sorted base addresses of live mappings
_mappings: dict[int, _Mapping] = {}


def _register(base: int, size: int, mm: mmap.mmap, fd: int) -> None:
    with _lock:
        if base not in _mappings:  # else: a dead mapping at the same address whose finalizer lags
            bisect.insort(_bases, base)
        _mappings[base] = _Mapping(base, size, mm, fd)
    weakref.finalize(mm, _forget, base, fd)


def _forget(base: int, fd: int) -> None:
    os.close(fd)
    with _lock:
        mapping = _mappings.get(base)
        if mapping is None or mapping.mm() is not None:
            return  # already replaced by a live mapping at the same address
        del _mappings[base]
        del _bases[bisect.bisect_left(_bases, base)]


def _lookup(ptr: int, nbytes: int) -> tuple[int, int] | None:
    """(memfd, offset of ptr) of the live mapping holding [ptr, ptr + nbytes), if any."""
    with _lock:
        i = bisect.bisect_right(_bases, ptr) - 1
        if i < 0:
            return None
        mapping = _mappings[_bases[i]]
    mm = mapping.mm()
    if mm is None or ptr + nbytes > mapping.base + mapping.size:
        return None
    return mapping.fd, ptr - mapping.base


#: A new pool is mapped populated: its pages are allocated and zeroed once, at start (~125 ms per
#: GiB), instead of by the first pulls that write each block (a 2 MiB block is 512 page faults).
#: An import maps without it: the exporter's pages exist already, a first touch only maps one, and
#: populating a large pool would stall the decode's loop during REGISTER.
_MAP_NEW = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
#: The size of a pool's memfd is sealed: a peer that shrank it under our mapping would make our
#: next read of the cut pages a SIGBUS, which kills the process (no exception to catch). Importers
#: refuse a memfd without F_SEAL_SHRINK.
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _check_sealed(fd: int) -> None:
    """IpcError unless `fd` is a memfd whose size can no longer shrink."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise IpcError(
            f"the shared fd is not a sealable memfd ({exc.strerror}); export pools allocated "
            "with shm_empty / KVPool.create"
        ) from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise IpcError(
            "the peer's memfd is not sealed against shrinking (F_SEAL_SHRINK): a shrink would "
            "crash this process on its next pull; export pools allocated with shm_empty"
        )


def shm_empty(shape: Sequence[int], dtype: torch.dtype, *, name: str = "pdkv") -> torch.Tensor:
    """An uninitialized (zero-filled) CPU tensor in a fresh memfd, shareable with ShmRegion.

    The memory is freed when the last tensor viewing it is collected. bf16/fp8 work: the bytes are
    mapped as uint8 and viewed as `dtype`.
    """
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise IpcError(f"shm_empty: negative dimension in shape {shape}")
    dtype_name(dtype)  # refuse dtypes that cannot travel
    nbytes = math.prod(shape) * dtype.itemsize
    size = max(nbytes, 1)  # mmap cannot map 0 bytes
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mm = mmap.mmap(fd, size, _MAP_NEW, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    _register(raw.data_ptr(), size, mm, fd)  # fd is closed when mm is collected
    return raw[:nbytes].view(dtype).view(shape)


def is_shm(tensor: torch.Tensor) -> bool:
    """True if `tensor` (or the view) lies in memory from shm_empty, so it can be exported."""
    if tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    return _lookup(storage.data_ptr(), storage.nbytes()) is not None


@register_backend
class ShmRegion(SharedRegion):
    """A memfd-backed CPU region; exporter holds a dup of the memfd, importer an mmap of it."""

    kind: ClassVar[str] = "shm"

    def __init__(
        self,
        desc: RegionDescriptor,
        *,
        tensor: torch.Tensor | None = None,
        fd: int | None = None,
        mm: mmap.mmap | None = None,
    ) -> None:
        super().__init__(desc)
        self._tensor = tensor
        self._mm = mm
        self._fd = fd
        # Close the exporter's fd even if close() is never called.
        self._fd_closer = weakref.finalize(self, os.close, fd) if fd is not None else None

    @classmethod
    def export(cls, tensor: torch.Tensor) -> ShmRegion:
        """Share a CPU tensor allocated by shm_empty (or any view into one).

        Non-contiguous views are shared as their contiguous permutation (see as_contiguous_view);
        the descriptor then carries the permuted shape. The region keeps the tensor alive.
        """
        if tensor.device.type != "cpu":
            raise IpcError(
                f"shm shares CPU memory only, got a tensor on {tensor.device}; "
                "use the cuda-torch or cuda-raw backend for GPU pools"
            )
        view = as_contiguous_view(tensor)
        nbytes = view.numel() * view.element_size()
        # Not view.data_ptr(): torch reports 0 for a tensor with no elements.
        ptr = view.untyped_storage().data_ptr() + view.storage_offset() * view.element_size()
        found = _lookup(ptr, nbytes)
        if found is None:
            raise IpcError(
                f"tensor of shape {tuple(tensor.shape)} ({tensor.dtype}) is not in shared memory; "
                f"{_ALLOC_HINT}"
            )
        memfd, offset = found
        desc = describe(cls.kind, view, handle=b"", offset=offset)
        return cls(desc, tensor=view, fd=os.dup(memfd))

    @classmethod
    def open(cls, desc: RegionDescriptor, fds: list[int]) -> ShmRegion:
        """Map the memfd in `fds` (exactly one) and check it holds desc's byte range.

        Takes ownership of `fds`: they are closed whether this succeeds or raises.
        """
        try:
            if desc.kind != cls.kind:
                raise IpcError(f"descriptor of kind {desc.kind!r} given to the shm backend")
            desc.check()
            if len(fds) != 1:
                raise IpcError(
                    f"shm region needs exactly one fd (the memfd), got {len(fds)}; "
                    "send region.fds() with the descriptor"
                )
            itemsize = dtype_from_name(desc.dtype).itemsize
            if desc.offset % itemsize:
                raise IpcError(
                    f"descriptor offset {desc.offset} is not a multiple of the {desc.dtype} "
                    f"item size {itemsize}"
                )
            _check_sealed(fds[0])
            size = os.fstat(fds[0]).st_size
            if size < desc.offset + desc.nbytes:
                raise IpcError(
                    f"shared memory holds {size} bytes but the descriptor needs bytes "
                    f"[{desc.offset}, {desc.offset + desc.nbytes}); wrong fd or descriptor"
                )
            mm = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            for fd in fds:
                os.close(fd)
        return cls(desc, mm=mm)

    def to_tensor(self) -> torch.Tensor:
        """The region as desc.dtype/desc.shape; shares memory with the peer. Drop before close()."""
        if self.closed:
            raise IpcError("shm region is closed; import it again to get a tensor")
        if self._tensor is None:
            assert self._mm is not None
            raw = torch.frombuffer(self._mm, dtype=torch.uint8)
            self._tensor = bytes_as(
                raw[self.desc.offset : self.desc.offset + self.desc.nbytes], self.desc
            )
        return self._tensor

    def fds(self) -> list[int]:
        """Exporter: [the memfd] to send with SCM_RIGHTS (still owned here). Importer: []."""
        if self._fd is None or self.closed:
            return []
        return [self._fd]

    def _close(self) -> None:
        self._tensor = None
        if self._fd_closer is not None:
            self._fd_closer()
        if self._mm is not None:
            # Never mm.close(): torch.frombuffer holds a reference to the mmap object, not a
            # buffer export, so close() would succeed and leave live tensors over unmapped pages
            # (a segfault on next touch). Dropping our reference unmaps now if no tensor is left,
            # or when the last one is collected.
            still_used = weakref.ref(self._mm)
            self._mm = None
            if still_used() is not None:
                log.warning(
                    "shm_close_deferred",
                    nbytes=self.desc.nbytes,
                    hint="drop tensors from to_tensor() before close(); unmapped when they go",
                )
