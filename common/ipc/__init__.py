"""IPC backends: one envelope (base.SharedRegion) and sibling backends that export and import.

`backend_for(kind)` maps a descriptor's kind to its class; CUDA backends register only when their
imports succeed, so a CPU-only machine never touches CUDA. The names below load `base` (and torch)
on first use, so `common.ipc.descriptor` stays importable without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RegionDescriptor", "SharedRegion", "backend_for", "register_backend"]


def __getattr__(name: str) -> Any:
    if name == "backend_for":
        from common.ipc import backends

        return backends.backend_for
    if name in __all__:
        from common.ipc import base

        return getattr(base, name)
    raise AttributeError(f"module 'common.ipc' has no attribute {name!r}")
