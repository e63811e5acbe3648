"""The wire form of a shared region, without torch (so clients and the CLI import no torch).

`common.ipc.base` re-exports it with the SharedRegion contract; see that module's docstring.
"""

from __future__ import annotations

import math

import msgspec

from common.errors import IpcError

#: Bytes per element of every dtype a region may carry (torch's names).
ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "uint8": 1,
    "int8": 1,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


class RegionDescriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Wire form of one shared region. Exporter → importer, inside REGISTER.

    `handle` is the backend's opaque handle (empty for shm, whose fd travels with SCM_RIGHTS);
    `offset` is the byte offset of the tensor's first byte from the start of the shared allocation;
    `strides` are in elements, as torch reports them; `device_uuid` is "" for CPU memory.
    """

    kind: str
    handle: bytes
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    device_uuid: str = ""

    def check(self) -> None:
        """Raise IpcError if the fields contradict each other (checked before any import)."""
        if self.dtype not in ITEMSIZE:
            raise IpcError(f"unknown dtype {self.dtype!r}; supported: {sorted(ITEMSIZE)}")
        if self.offset < 0 or self.nbytes < 0:
            raise IpcError(f"negative offset {self.offset} or nbytes {self.nbytes} in descriptor")
        if len(self.shape) != len(self.strides) or any(d < 0 for d in self.shape):
            raise IpcError(f"bad shape {self.shape} / strides {self.strides} in descriptor")
        if self.strides != contiguous_strides(self.shape):
            raise IpcError(
                f"descriptor strides {self.strides} are not contiguous for shape {self.shape}"
            )
        expected = math.prod(self.shape) * ITEMSIZE[self.dtype]
        if expected != self.nbytes:
            raise IpcError(
                f"descriptor nbytes {self.nbytes} does not match shape {self.shape} x "
                f"{self.dtype} = {expected} bytes"
            )


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a contiguous tensor of `shape`."""
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(strides))
