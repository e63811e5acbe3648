"""The weights arena: every tensor of a model in one flat allocation, at offsets the config fixes.

One allocation means one handle shares all the weights with another process (common.ipc.weights);
`WeightsLayout` is a pure function of (config, dtype, whether lm_head is its own tensor), so the
process that maps an arena checks it against the layout it would have built itself (`digest`).
Slots are 256-byte aligned: the kernels' vector loads and cuBLAS want aligned rows.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from common.model.config import LlamaConfig
from common.model.llama import LayerWeights, LlamaWeights

ALIGN = 256


@dataclass(frozen=True)
class Slot:
    name: str  # "embed", "lm_head", "norm", "layers.N.qkv", ...
    offset: int  # bytes from the arena's start
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WeightsLayout:
    """Where each weight lives in the arena; `nbytes` is the arena's size."""

    dtype: torch.dtype
    slots: dict[str, Slot]
    nbytes: int
    separate_head: bool
    num_layers: int

    @classmethod
    def of(cls, config: LlamaConfig, dtype: torch.dtype, *, separate_head: bool) -> WeightsLayout:
        """The layout for `config` in `dtype`; `separate_head`: lm_head is a tensor of its own
        (False: it is the embedding, tied)."""
        c = config
        h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * d
        shapes: list[tuple[str, tuple[int, ...]]] = [("embed", (c.vocab_size, h))]
        if separate_head:
            shapes.append(("lm_head", (c.vocab_size, h)))
        shapes.append(("norm", (h,)))
        for n in range(c.num_layers):
            p = f"layers.{n}."
            shapes += [
                (p + "input_norm", (h,)),
                (p + "qkv", (qkv_rows, h)),
                (p + "o", (h, c.num_heads * d)),
                (p + "post_norm", (h,)),
                (p + "gate_up", (2 * i, h)),
                (p + "down", (h, i)),
            ]
            if c.qkv_bias:
                shapes.append((p + "qkv_bias", (qkv_rows,)))
            if c.qk_norm:
                shapes += [(p + "q_norm", (d,)), (p + "k_norm", (d,))]
        slots, offset = {}, 0
        for name, shape in shapes:
            slots[name] = Slot(name, offset, shape)
            offset += _aligned(math.prod(shape) * dtype.itemsize)
        return cls(dtype, slots, max(offset, ALIGN), separate_head, c.num_layers)

    def digest(self) -> str:
        """sha256 of the dtype and every slot (name, offset, shape): equal digests, equal views."""
        h = hashlib.sha256(str(self.dtype).encode())
        for s in self.slots.values():
            h.update(f"{s.name}@{s.offset}:{s.shape};".encode())
        return h.hexdigest()[:32]

    def allocate(self, device: torch.device, *, shared: bool = False) -> torch.Tensor:
        """A new zeroed arena: flat uint8 of `nbytes`; on CPU with `shared` in a memfd (so it can
        be exported by the shm backend)."""
        if shared and device.type == "cpu":
            from common.ipc.shm import shm_empty

            return shm_empty((self.nbytes,), torch.uint8, name="pdkv-weights")
        return torch.zeros(self.nbytes, dtype=torch.uint8, device=device)

    def view(self, arena: torch.Tensor, name: str) -> torch.Tensor:
        """Slot `name` of `arena` as a tensor of its dtype and shape (no copy)."""
        s = self.slots[name]
        nbytes = math.prod(s.shape) * self.dtype.itemsize
        return arena[s.offset : s.offset + nbytes].view(self.dtype).view(s.shape)

    def weights(self, arena: torch.Tensor) -> LlamaWeights:
        """The model's weights as views of `arena` (lm_head is the embed view when tied)."""
        if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.numel() != self.nbytes:
            raise ValueError(
                f"arena must be flat uint8 of {self.nbytes} bytes, got {arena.dtype} "
                f"{tuple(arena.shape)}"
            )

        def get(name: str) -> torch.Tensor | None:
            return self.view(arena, name) if name in self.slots else None

        layers = [
            LayerWeights(
                **{f: get(f"layers.{n}.{f}") for f in LayerWeights.__dataclass_fields__}  # type: ignore[arg-type]
            )
            for n in range(self.num_layers)
        ]
        embed = self.view(arena, "embed")
        head = self.view(arena, "lm_head") if self.separate_head else embed
        return LlamaWeights(embed=embed, layers=layers, norm=self.view(arena, "norm"), lm_head=head)

    def fill(self, arena: torch.Tensor, w: LlamaWeights) -> None:
        """Copy `w` (any device, any dtype) into `arena`'s slots, casting to the layout's dtype."""
        self.view(arena, "embed").copy_(w.embed)
        if self.separate_head:
            self.view(arena, "lm_head").copy_(w.lm_head)
        self.view(arena, "norm").copy_(w.norm)
        for n, lw in enumerate(w.layers):
            for f in LayerWeights.__dataclass_fields__:
                t = getattr(lw, f)
                if t is not None:
                    self.view(arena, f"layers.{n}.{f}").copy_(t)


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


__all__ = ["ALIGN", "Slot", "WeightsLayout"]
