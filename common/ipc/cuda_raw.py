"""`cuda-raw` backend: CUDA IPC of device memory through the csrc extension.

Exporter: the tensor's allocation base comes from cuMemGetAddressRange, its handle from
cudaIpcGetMemHandle; the descriptor carries the byte offset of the tensor from that base (with the
caching allocator the base often holds a different tensor, so the offset is mandatory).
Importer: the extension's registry opens each allocation once per process (cudaIpcOpenMemHandle
with lazy peer access, on the local ordinal of the exporter's GPU UUID), counts references, and
hands the mapping over as a DLPack capsule; the mapping is closed when the last tensor over it is
freed. Bytes travel as uint8 and `bytes_as` restores dtype and shape, so fp16/bf16/fp8 share one
path. Nothing from torch's C++ ABI is used.
"""

from __future__ import annotations

import structlog
import torch

from common.cuda import cuda_errors, device_uuid, ext, has_extension, ordinal_for_uuid
from common.errors import IpcError
from common.ipc.base import (
    RegionDescriptor,
    SharedRegion,
    bytes_as,
    cuda_view,
    describe,
    register_backend,
)

log = structlog.get_logger(__name__)


@register_backend
class CudaRawRegion(SharedRegion):
    """A CUDA region shared with cudaIpc*Handle through common._cuda."""

    kind = "cuda-raw"

    def __init__(self, desc: RegionDescriptor, tensor: torch.Tensor) -> None:
        super().__init__(desc)
        self._tensor: torch.Tensor | None = tensor

    @classmethod
    def export(cls, tensor: torch.Tensor) -> CudaRawRegion:
        """Share `tensor` (CUDA, contiguous or a permutation of contiguous, not empty).

        The region holds a reference to the tensor, so its memory outlives every export.
        """
        view = cuda_view(tensor, cls.kind)
        with cuda_errors():
            handle, offset, _size, device = ext().export_mem(view.data_ptr())
        desc = describe(
            cls.kind,
            view,
            handle=bytes(handle),
            offset=int(offset),
            device_uuid=device_uuid(int(device)),
        )
        return cls(desc, view)

    @classmethod
    def open(cls, desc: RegionDescriptor, fds: list[int]) -> CudaRawRegion:
        """Map `desc` in the context of the GPU that holds it (found by UUID)."""
        return cls.open_on(desc, None)

    @classmethod
    def open_on(cls, desc: RegionDescriptor, device: int | None) -> CudaRawRegion:
        """Map `desc` in the context of local GPU `device` (None: the GPU that holds it).

        A GPU other than the owner reads the memory over NVLink (peer access is enabled lazily);
        a kernel on GPU1 can only read a GPU0 pool that was mapped with GPU1 current, so a decode
        daemon pulling onto another GPU opens the peer's pool with its own device.
        """
        if desc.kind != cls.kind:
            raise IpcError(f"descriptor of kind {desc.kind!r} given to the {cls.kind} backend")
        desc.check()
        owner = ordinal_for_uuid(desc.device_uuid)
        device = owner if device is None else device
        with cuda_errors():
            capsule = ext().import_mem(desc.handle, desc.offset, desc.nbytes, device)
        raw = torch.from_dlpack(capsule)
        return cls(desc, bytes_as(raw, desc))

    @classmethod
    def open_for(
        cls, desc: RegionDescriptor, fds: list[int], device: torch.device
    ) -> CudaRawRegion:
        """Map in the consumer's GPU context (see open_on)."""
        return cls.open_on(desc, device.index if device.type == "cuda" else None)

    def to_tensor(self) -> torch.Tensor:
        """The shared tensor; IpcError after close()."""
        if self._tensor is None:
            raise IpcError(f"{self.kind} region is closed")
        return self._tensor

    def _close(self) -> None:
        # Dropping our reference lets the capsule deleter close the mapping once no other tensor
        # over it is alive; deleters cannot raise, so collect what they saw.
        self._tensor = None
        if has_extension():
            for error in ext().take_close_errors():
                log.warning("ipc_close_failed", kind=self.kind, error=error)
