"""IPC backends: one envelope (base.SharedRegion) and sibling backends that export and import.

`backend_for(kind)` maps a descriptor's kind to its class; CUDA backends register only when their
imports succeed, so a CPU-only machine never touches CUDA.
"""

from __future__ import annotations

from common.ipc.base import RegionDescriptor, SharedRegion, backend_for, register_backend

__all__ = ["RegionDescriptor", "SharedRegion", "backend_for", "register_backend"]
