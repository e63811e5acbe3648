"""The backend registry: a descriptor's kind → its SharedRegion class.

The backends register themselves (`base.register_backend`) when imported; this module imports them
on first use, the CUDA ones only when a CUDA kind is asked for, so a CPU-only process never loads
them. It sits above the backends, and `base` below them, so nothing imports in a circle.
"""

from __future__ import annotations

from common.errors import IpcError
from common.ipc.base import _BACKENDS, SharedRegion


def backend_for(kind: str) -> type[SharedRegion]:
    """The backend class for `kind`; IpcError naming the available kinds otherwise."""
    if kind not in _BACKENDS:
        import common.ipc.shm

        if kind.startswith("cuda"):
            try:
                import common.ipc.cuda_raw
                import common.ipc.cuda_torch  # noqa: F401
            except ImportError as exc:
                raise IpcError(f"IPC backend {kind!r} unavailable here: {exc}") from exc
    try:
        return _BACKENDS[kind]
    except KeyError:
        raise IpcError(f"unknown IPC backend {kind!r}; available: {sorted(_BACKENDS)}") from None


__all__ = ["backend_for"]
