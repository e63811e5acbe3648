"""Share and open a pool's memory: the two IPC steps both transfer sides and CacheManager use.

`export_region` is the owner's (once per pool per process: the descriptor is re-sent to every
peer); `open_region` the importer's (once per pool per link), mapped in the importer's device
context so the copy kernel on that device can read it. `default_backend` names the backend a
device uses when none is chosen; `close_fds` closes fds that no mapping took over.
"""

from __future__ import annotations

import contextlib
import os

import torch

from common.ipc.backends import backend_for
from common.ipc.base import RegionDescriptor, SharedRegion


def default_backend(device: torch.device) -> str:
    """shm on CPU; on CUDA cuda-raw when the extension is built, else cuda-torch."""
    if device.type == "cpu":
        return "shm"
    try:
        from common import _cuda  # noqa: F401
    except ImportError:
        return "cuda-torch"
    return "cuda-raw"


def export_region(tensor: torch.Tensor, backend: str | None = None) -> SharedRegion:
    """Share `tensor`'s memory with `backend` (default: the device's); close() when done."""
    return backend_for(backend or default_backend(tensor.device)).export(tensor)


def open_region(desc: RegionDescriptor, fds: list[int], device: torch.device) -> SharedRegion:
    """Map a peer's region for a consumer on `device` (takes over `fds`)."""
    return backend_for(desc.kind).open_for(desc, fds, device)


def close_fds(fds: list[int]) -> None:
    """Close each fd, ignoring any already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


__all__ = ["close_fds", "default_backend", "export_region", "open_region"]
