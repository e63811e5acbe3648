"""GPU memory that outlives its exporter, shared as a file descriptor (csrc/vmm.cpp).

A VMM allocation (`cuMemCreate`) exported as a POSIX fd is to a GPU what a memfd is to the host:
its physical memory lives while any process holds a handle or a mapping, and whoever holds the fd
may pass it on (SCM_RIGHTS). The weights arena uses it (common.ipc.weights), so that an importer
keeps its weights when their first owner exits. Importers map it read-only
(`CU_MEM_ACCESS_FLAGS_PROT_READ`): a stray write faults instead of changing the owner's model.
Legacy CUDA IPC (`cudaIpcGetMemHandle`, the pools' backends) has neither property.
"""

from __future__ import annotations

import functools

import structlog
import torch

from common.errors import CudaError

log = structlog.get_logger(__name__)
KIND = "cuda-vmm"


@functools.cache
def usable(device_index: int) -> bool:
    """True when this process can make a shareable VMM allocation on the GPU (the extension is
    built with it and the driver answers its granularity query)."""
    from common.cuda import cuda_errors, ext, has_extension

    if not has_extension() or not hasattr(ext(), "vmm_create"):
        return False
    try:
        with cuda_errors():
            return ext().vmm_granularity(device_index) > 0
    except CudaError as exc:
        log.info("vmm_unusable", device=device_index, error=str(exc))
        return False


def vmm_empty(nbytes: int, device: torch.device) -> tuple[torch.Tensor, int, int]:
    """(a zeroed uint8 tensor of `nbytes` on `device`, the fd sharing it (the caller's to close),
    the allocation's size). The memory is released when the tensor and every importer's are."""
    from common.cuda import cuda_errors, ext

    with cuda_errors():
        capsule, fd, size = ext().vmm_create(nbytes, device.index or 0)
    tensor = torch.from_dlpack(capsule)
    tensor.zero_()
    return tensor, int(fd), int(size)


def vmm_open(fd: int, size: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """The first `nbytes` of the allocation `fd` shares (`size` bytes), mapped read-only on
    `device`. The fd stays the caller's."""
    from common.cuda import cuda_errors, ext

    with cuda_errors():
        capsule = ext().vmm_import(fd, size, nbytes, device.index or 0, True)
    return torch.from_dlpack(capsule)


__all__ = ["KIND", "usable", "vmm_empty", "vmm_open"]
