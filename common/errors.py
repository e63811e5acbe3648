"""Exception hierarchy shared by both daemons and the library API.

Every error a user can see derives from PdkvError, so a caller can catch one type. Messages name
what was wrong and, where there is one, the setting to change.
"""

from __future__ import annotations


class PdkvError(Exception):
    """Base of every pdkv error."""


class ProtocolError(PdkvError):
    """Bytes on a socket that do not form a valid frame or message."""


class AllocatorError(PdkvError):
    """Misuse of the block allocator (double free, unknown request, bad block id)."""


class OutOfBlocks(AllocatorError):
    """The pool has fewer free blocks than a request needs."""

    def __init__(self, requested: int, free: int, total: int) -> None:
        super().__init__(
            f"out of KV blocks: requested {requested}, free {free} of {total} "
            "(raise --num-blocks, or lower the concurrency or prompt length)"
        )
        self.requested = requested
        self.free = free
        self.total = total


class IpcError(PdkvError):
    """A shared region could not be exported, imported or matched with its descriptor."""


class CudaError(IpcError):
    """A CUDA runtime or driver call failed; the message names the CUDA error and a hint."""


class ModelError(PdkvError):
    """A model directory or configuration that pdkv cannot load."""
