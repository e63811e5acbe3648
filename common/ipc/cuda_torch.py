"""`cuda-torch` backend: CUDA IPC through PyTorch storage sharing.

Exporter: `untyped_storage()._share_cuda_()` gives the allocation's handle, the storage's offset in
it, and torch's producer-side reference counter and event; they travel msgpack-encoded in the
descriptor's `handle` bytes (never pickle). Importer: `UntypedStorage._new_shared_cuda` on the local
ordinal of the exporter's GPU UUID, with a per-process cache so that a second import of the same
storage does not consume torch's reference counter twice. Bytes travel as uint8 and `bytes_as`
restores dtype and shape.
"""

from __future__ import annotations

import msgspec
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from common.cuda import device_uuid, ordinal_for_uuid
from common.errors import IpcError
from common.ipc.base import (
    RegionDescriptor,
    SharedRegion,
    bytes_as,
    cuda_view,
    describe,
    register_backend,
)


class TorchHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What `_share_cuda_` returns besides the device, inside RegionDescriptor.handle."""

    handle: bytes
    storage_nbytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


_CACHE: dict[tuple[bytes, int], StorageWeakRef] = {}


def _shared_storage(meta: TorchHandle, device: int) -> torch.UntypedStorage:
    key = (meta.handle, meta.storage_offset)
    cached = _CACHE.get(key)
    if cached is not None and not cached.expired():
        storage = torch.UntypedStorage._new_with_weak_ptr(cached.cdata)
        if storage is not None:
            return storage
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device,
        meta.handle,
        meta.storage_nbytes,
        meta.storage_offset,
        meta.ref_counter_handle,
        meta.ref_counter_offset,
        meta.event_handle,
        meta.event_sync_required,
    )
    _CACHE[key] = StorageWeakRef(storage)
    return storage


@register_backend
class CudaTorchRegion(SharedRegion):
    """A CUDA region shared through torch's storage IPC."""

    kind = "cuda-torch"

    def __init__(self, desc: RegionDescriptor, tensor: torch.Tensor) -> None:
        super().__init__(desc)
        self._tensor: torch.Tensor | None = tensor

    @classmethod
    def export(cls, tensor: torch.Tensor) -> CudaTorchRegion:
        """Share `tensor` (CUDA, contiguous or a permutation of contiguous, not empty)."""
        view = cuda_view(tensor, cls.kind)
        (device, handle, size, st_offset, rc_handle, rc_offset, ev_handle, ev_sync) = (
            view.untyped_storage()._share_cuda_()
        )
        meta = TorchHandle(
            handle=bytes(handle),
            storage_nbytes=int(size),
            storage_offset=int(st_offset),
            ref_counter_handle=bytes(rc_handle),
            ref_counter_offset=int(rc_offset),
            event_handle=bytes(ev_handle) if ev_handle else None,
            event_sync_required=bool(ev_sync),
        )
        desc = describe(
            cls.kind,
            view,
            handle=msgspec.msgpack.encode(meta),
            offset=int(st_offset) + view.storage_offset() * view.element_size(),
            device_uuid=device_uuid(int(device)),
        )
        return cls(desc, view)

    @classmethod
    def open(cls, desc: RegionDescriptor, fds: list[int]) -> CudaTorchRegion:
        """Rebuild the storage on the local GPU with desc's UUID and view the tensor's bytes."""
        if desc.kind != cls.kind:
            raise IpcError(f"descriptor of kind {desc.kind!r} given to the {cls.kind} backend")
        desc.check()
        try:
            meta = msgspec.msgpack.decode(desc.handle, type=TorchHandle)
        except msgspec.DecodeError as exc:
            raise IpcError(f"cuda-torch handle does not decode: {exc}") from None
        start = desc.offset - meta.storage_offset
        if start < 0 or start + desc.nbytes > meta.storage_nbytes:
            raise IpcError(
                f"region [{desc.offset}, +{desc.nbytes}) lies outside its storage "
                f"[{meta.storage_offset}, +{meta.storage_nbytes})"
            )
        device = ordinal_for_uuid(desc.device_uuid)
        storage = _shared_storage(meta, device)
        raw = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
        raw.set_(storage, start, (desc.nbytes,), (1,))
        return cls(desc, bytes_as(raw, desc))

    def to_tensor(self) -> torch.Tensor:
        """The shared tensor; IpcError after close()."""
        if self._tensor is None:
            raise IpcError(f"{self.kind} region is closed")
        return self._tensor

    def _close(self) -> None:
        # torch closes the mapping and decrements the producer's counter when the storage dies.
        self._tensor = None
