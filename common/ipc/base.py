"""The envelope every IPC backend shares: the wire form of a region and the import/close contract.

Design (as LMCache's DeviceIPCWrapper): the base owns the fields that travel (kind, handle bytes,
byte offset from the allocation base, nbytes, dtype, shape, strides, device UUID), their checks,
and the dtype round trip; a sibling backend implements only `export` (exporter side), `open`
(importer side), `to_tensor` and `_close`. Bytes travel as uint8 and the dtype is restored with
`view(dtype)`, so fp32/fp16/bf16/fp8 pools share one path.

Contract:
- `export(tensor)` is called once per pool per process by the owner of the memory; the returned
  region keeps whatever it needs (an fd, a handle) alive until `close()`, and its descriptor is
  sent to every peer.
- `open(desc, fds)` is called once per pool per link by the peer; `to_tensor()` returns a tensor of
  exactly `desc.shape`/`desc.dtype` over the shared memory.
- `close()` is idempotent and never raises: it logs, because raising would abort the cleanup of
  everything after it. Tensors returned by `to_tensor()` must not be used after `close()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import structlog
import torch

from common.errors import IpcError
from common.ipc.descriptor import ITEMSIZE, RegionDescriptor, contiguous_strides

__all__ = [
    "ITEMSIZE",
    "RegionDescriptor",
    "SharedRegion",
    "as_contiguous_view",
    "bytes_as",
    "contiguous_strides",
    "cuda_view",
    "describe",
    "dtype_from_name",
    "dtype_name",
    "register_backend",
]

log = structlog.get_logger(__name__)

# dtype names on the wire; fp8 kinds only where this torch has them.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype ("bfloat16"); IpcError for one pdkv does not carry."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise IpcError(f"dtype {dtype} cannot be shared; supported: {sorted(_DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """torch dtype of a wire name; IpcError naming the supported ones otherwise."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise IpcError(f"unknown dtype {name!r}; supported: {sorted(_DTYPES)}") from None


def as_contiguous_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself if contiguous, or a metadata-only permutation of it that is contiguous.

    A permutation is found by sorting dimensions by stride; if the permuted view is still not
    contiguous (a slice with gaps, an expanded dim) the tensor is refused: sharing it would need a
    copy, and a copy is not the memory the peer expects to see.
    """
    if tensor.is_contiguous():
        return tensor
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), -tensor.size(d)))
    permuted = tensor.permute(*order)
    if permuted.is_contiguous():
        return permuted
    raise IpcError(
        f"cannot share a non-contiguous tensor of shape {tuple(tensor.shape)} and strides "
        f"{tuple(tensor.stride())}: no permutation of it is contiguous; share the base tensor "
        "or make it contiguous first"
    )


def cuda_view(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """What a CUDA backend shares of `tensor`: its contiguous view; IpcError for a CPU or empty
    tensor, or one no permutation makes contiguous."""
    if not tensor.is_cuda:
        raise IpcError(
            f"{kind} exports CUDA tensors only, got one on {tensor.device}; "
            "use the shm backend for CPU pools"
        )
    view = as_contiguous_view(tensor)
    if view.numel() == 0:
        raise IpcError(f"cannot share an empty tensor of shape {tuple(view.shape)}")
    return view


def describe(
    kind: str, view: torch.Tensor, *, handle: bytes, offset: int, device_uuid: str = ""
) -> RegionDescriptor:
    """The descriptor of contiguous `view`, found at byte `offset` of the shared allocation."""
    return RegionDescriptor(
        kind=kind,
        handle=handle,
        offset=offset,
        nbytes=view.numel() * view.element_size(),
        dtype=dtype_name(view.dtype),
        shape=tuple(view.shape),
        strides=contiguous_strides(tuple(view.shape)),
        device_uuid=device_uuid,
    )


def bytes_as(raw: torch.Tensor, desc: RegionDescriptor) -> torch.Tensor:
    """View a flat uint8 tensor of desc.nbytes bytes as desc's dtype and shape (no copy)."""
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise IpcError(f"expected a flat uint8 tensor, got {raw.dtype} of shape {tuple(raw.shape)}")
    if raw.numel() != desc.nbytes:
        raise IpcError(f"shared region holds {raw.numel()} bytes, descriptor says {desc.nbytes}")
    return raw.view(dtype_from_name(desc.dtype)).view(desc.shape)


class SharedRegion(ABC):
    """One shared memory region, exporting or importing side. See the module docstring."""

    kind: ClassVar[str]

    def __init__(self, desc: RegionDescriptor) -> None:
        self.desc = desc
        self._closed = False

    @classmethod
    @abstractmethod
    def export(cls, tensor: torch.Tensor) -> SharedRegion:
        """Exporter side: share `tensor`'s memory. The region keeps it alive until close()."""

    @classmethod
    @abstractmethod
    def open(cls, desc: RegionDescriptor, fds: list[int]) -> SharedRegion:
        """Importer side: map the region `desc` names (fds as received with SCM_RIGHTS)."""

    @classmethod
    def open_for(cls, desc: RegionDescriptor, fds: list[int], device: torch.device) -> SharedRegion:
        """Importer side, for a consumer on `device`: a backend that can map the region into that
        device's context (cuda-raw, so a kernel on another GPU may read it) overrides this; the
        others open as usual."""
        return cls.open(desc, fds)

    @abstractmethod
    def to_tensor(self) -> torch.Tensor:
        """The region as a tensor of desc.dtype and desc.shape."""

    @abstractmethod
    def _close(self) -> None:
        """Release what this side holds; may raise, close() logs it."""

    def fds(self) -> list[int]:
        """File descriptors that must travel with the descriptor (SCM_RIGHTS); none by default."""
        return []

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Idempotent; logs instead of raising."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close()
        except Exception as exc:
            log.warning("ipc_close_failed", kind=self.kind, error=str(exc))

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_BACKENDS: dict[str, type[SharedRegion]] = {}


def register_backend(cls: type[SharedRegion]) -> type[SharedRegion]:
    """Class decorator: make `cls` the backend for descriptors of kind `cls.kind`
    (looked up through common.ipc.backends.backend_for)."""
    _BACKENDS[cls.kind] = cls
    return cls
