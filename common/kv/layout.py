"""A paged KV pool's geometry and dtype: what REGISTER carries and what two pools must share.

Shape: (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim); index 0/1 of dim 2 is K/V
(common.kv.pool holds the tensor of that shape).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from common.errors import IpcError
from common.ipc.base import dtype_from_name


@dataclass(frozen=True)
class PoolLayout:
    """Geometry and dtype of a paged KV pool. `dtype` is a wire name ("bfloat16", "float32")."""

    num_blocks: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "dtype":
                if not isinstance(value, str):
                    raise IpcError(f"pool layout dtype must be a wire name str, got {value!r}")
                dtype_from_name(value)  # IpcError naming the supported dtypes
            elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise IpcError(f"pool layout {f.name} must be a positive int, got {value!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, *self.block_shape)

    @property
    def block_nbytes(self) -> int:
        return math.prod(self.block_shape) * self.torch_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    def to_wire(self) -> dict[str, Any]:
        """Plain dict for JSON metadata (REGISTER, HELLO)."""
        return asdict(self)

    @classmethod
    def from_wire(cls, data: object) -> PoolLayout:
        """Inverse of to_wire; IpcError naming the bad, missing or unknown field."""
        if not isinstance(data, dict):
            raise IpcError(f"pool layout must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        missing, unknown = names - data.keys(), data.keys() - names
        if missing or unknown:
            raise IpcError(
                f"pool layout fields wrong: missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        return cls(**data)

    def compat_fields(self) -> dict[str, Any]:
        """What two pools must share for blocks to move between them (num_blocks may differ)."""
        wire = self.to_wire()
        del wire["num_blocks"]
        return wire


__all__ = ["PoolLayout"]
