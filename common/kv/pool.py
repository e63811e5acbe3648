"""Paged KV pool: one contiguous, block-major tensor per daemon, and the block pull between pools.

Shape: (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim); index 0/1 of dim 2 is K/V.
Block-major means one block's K and V for every layer is one contiguous byte range, so a pull of
adjacent blocks is one memcpy and a pool can be shared as a single region (common.ipc). The
attention scatter/gather (common.model.paged) works on `pool.tensor` in exactly this shape.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from common.cuda import has_extension
from common.errors import IpcError
from common.kv.blockids import BlockIds, block_id_array, check_block_ids
from common.kv.layout import PoolLayout

# A pull copies run by run (one memcpy per run of adjacent blocks) while that is cheaper than one
# gather + one scatter (index_select/index_copy_, which moves every byte twice). Measured on the
# 2-core CPU box, 64 blocks: a run costs ~9 µs of Python/dispatch; the indexed path wins for
# fragmented lists of small blocks (8 KiB: above ~4 runs; 64 KiB: above ~32) and loses at any run
# count once blocks reach ~128 KiB. On CUDA the pull is common.kv.blockcopy's single kernel launch.
_MIN_RUN_LIMIT = 4
_RUN_BYTES_BREAK_EVEN = 2048  # CPU: runs allowed per pull ≈ block_nbytes / this
_SMALL = 32  # id lists up to this long find their runs in plain Python


class KVPool:
    """A paged KV pool over one tensor of `layout.shape`; the tensor may be local or imported."""

    def __init__(self, layout: PoolLayout, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != layout.shape or tensor.dtype != layout.torch_dtype:
            raise IpcError(
                f"pool tensor is {tuple(tensor.shape)} {tensor.dtype}, layout needs "
                f"{layout.shape} {layout.torch_dtype}; both sides must use the same layout"
            )
        if not tensor.is_contiguous():
            raise IpcError(f"pool tensor must be contiguous, got strides {tuple(tensor.stride())}")
        self.layout = layout
        self.tensor = tensor
        self._compat = layout.compat_fields()  # compared on every pull
        # CPU pulls copy runs of blocks with memmove on these addresses: a torch slice + copy_
        # costs ~8 µs per run in dispatch, memmove of a few KiB well under 1 µs
        self._addr = tensor.data_ptr() if tensor.device.type == "cpu" else 0
        self._block_nbytes = layout.block_nbytes
        start = tensor.data_ptr()
        self._span = (start, start + tensor.numel() * tensor.element_size())
        self._dev = (tensor.device.type, tensor.device.index)

    def _overlaps(self, src: KVPool) -> bool:
        """True when src's memory and ours intersect on one device: the same pool, or two pool
        objects over the same pages. Such a pull must take the snapshot path (gather, then
        scatter), since a run copied early could overwrite a block a later run reads."""
        return (
            src._dev == self._dev and src._span[0] < self._span[1] and self._span[0] < src._span[1]
        )

    @classmethod
    def create(cls, layout: PoolLayout, device: str | torch.device = "cpu") -> KVPool:
        """A new zeroed pool: in a memfd on CPU (shareable with the shm backend), else torch.zeros."""
        device = torch.device(device)
        if device.type == "cpu":
            from common.ipc.shm import shm_empty  # memfd pages start zeroed

            return cls(layout, shm_empty(layout.shape, layout.torch_dtype, name="pdkv-kv"))
        return cls(layout, torch.zeros(layout.shape, dtype=layout.torch_dtype, device=device))

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def fingerprint_fields(self) -> dict[str, Any]:
        """Layout fields a compatibility hash must cover (all but num_blocks)."""
        return self.layout.compat_fields()

    def block_view(self, block_ids: int | BlockIds) -> torch.Tensor:
        """A view (writes reach the pool) of one block, or of ids forming one ascending run.

        Other id lists are refused: use `gather` for a copy of scattered blocks.
        """
        if isinstance(block_ids, int):
            ids = self._ids([block_ids], "block")
            return self.tensor[int(ids[0])]
        ids = self._ids(block_ids, "block")
        runs = _runs(ids, ids)
        if len(runs) > 1:
            raise IpcError(
                f"block ids {ids.tolist()} are not one run of adjacent blocks; a view cannot "
                "cover them — use KVPool.gather() for a copy"
            )
        start, _, length = runs[0] if runs else (0, 0, 0)
        return self.tensor[start : start + length]

    def words(self, block: int, n: int) -> torch.Tensor:
        """A view of the first n int64 words of block `block` (the first-token mailbox, v12:
        one word per event slot); IpcError if the block does not exist or holds fewer."""
        (bid,) = self._ids([block], "block")
        if self.layout.block_nbytes // 8 < n:
            raise IpcError(
                f"a block of {self.layout.block_nbytes} bytes cannot hold {n} int64 words"
            )
        return self.tensor[int(bid)].view(-1).view(torch.int64)[:n]

    def gather(self, block_ids: BlockIds) -> torch.Tensor:
        """A copy of the given blocks, in order, shape (len(ids), *layout.block_shape)."""
        ids = self._ids(block_ids, "block")
        return self.tensor.index_select(0, torch.from_numpy(ids).to(self.device))

    def copy_blocks_from(
        self,
        src: KVPool,
        src_ids: BlockIds,
        dst_ids: BlockIds,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Copy blocks src_ids[i] of `src` into blocks dst_ids[i] of this pool (the pull).

        Layouts must match except for num_blocks; ids must be in range, equally many, and the
        destination ids distinct. Between distinct CPU pools, each run of adjacent ids is one
        memmove; a copy within one pool (or between two pools over the same memory) takes one
        gather + one scatter, which is safe when source and destination blocks overlap. On one GPU
        it is common.kv.blockcopy's kernel, queued on `stream` (default: the current stream), the
        ids passed as launch parameters: the caller orders it after the producer's event and
        records an event (or synchronizes) before reading the result. A source on another device
        is read through torch's peer copy, the gather on its GPU ordered after this device's
        current stream too. This is the one block copy of the project: the daemons' pulls and
        the CacheManager all come here.
        """
        if (
            type(src_ids) is list
            and type(dst_ids) is list
            and len(dst_ids) <= _SMALL
            and src._addr  # CPU pools (a torch.device per .device costs ~0.5 µs here)
            and self._addr
            and not self._overlaps(src)
        ):
            self._copy_few(src, src_ids, dst_ids)  # the handoff's common case, in a few µs
            return
        s, d = self._checked_ids(src, src_ids, dst_ids)
        if d.size == 0:
            return
        overlap = self._overlaps(src)
        kernel = not overlap and self._dev == src._dev and self._dev[0] == "cuda"
        if stream is not None and not (kernel and has_extension()):
            with torch.cuda.stream(stream):  # torch's copies run on the current stream
                self.copy_blocks_from(src, s, d)
            return
        if not overlap and src.device != self.device:
            # another device, or memory mapped in another GPU's context (cuda-torch imports):
            # torch's peer copy reads it, a kernel on this GPU could not; the gather on the
            # source GPU is ordered after our current stream (the producer's event wait)
            from common.kv.blockcopy import gather_after, ids_on

            picked = gather_after(src.tensor, torch.from_numpy(s), self.device)
            self.tensor.index_copy_(0, ids_on(torch.from_numpy(d), self.device), picked)
            return
        if kernel:
            from common.kv.blockcopy import copy_checked_blocks, copy_ids_cuda

            if has_extension():  # one launch per 480 blocks, nothing else on the host
                copy_ids_cuda(self.tensor, src.tensor, s, d, stream)
            else:
                copy_checked_blocks(
                    self.tensor, src.tensor, torch.from_numpy(d), torch.from_numpy(s)
                )
            return
        runs = _runs(s, d)
        if not overlap and src._addr and self._addr:
            self._memmove_runs(src, runs)
            return
        if not overlap and len(runs) <= self._run_limit():
            for s0, d0, n in runs:
                self.tensor[d0 : d0 + n].copy_(src.tensor[s0 : s0 + n])
            return
        picked = src.tensor.index_select(0, torch.from_numpy(s).to(src.device))
        self.tensor.index_copy_(0, torch.from_numpy(d).to(self.device), picked)

    def plan_kernel_copy(self, src: KVPool, src_ids: BlockIds, dst_ids: BlockIds) -> Any:
        """`copy_blocks_from` checked and made ready ahead of time, when it would be the one
        kernel launch (one GPU, distinct pools, the extension built): a
        common.kv.blockcopy.KernelCopy to `launch(stream)` later, else None (copy then with
        copy_blocks_from). Raises IpcError as copy_blocks_from would."""
        if not (self._dev == src._dev and self._dev[0] == "cuda" and has_extension()):
            return None
        if self._overlaps(src):
            return None  # copy_blocks_from takes the snapshot path
        s, d = self._checked_ids(src, src_ids, dst_ids)
        if not d.size:
            return None
        from common.kv.blockcopy import KernelCopy

        return KernelCopy.between(self.tensor, src.tensor, s, d)

    def _checked_ids(
        self, src: KVPool, src_ids: BlockIds, dst_ids: BlockIds
    ) -> tuple[np.ndarray, np.ndarray]:
        """A pull's checks (pools of one block layout, ids in range, as many of each, distinct
        destinations): the ids as int64 arrays, or IpcError saying what is wrong."""
        if src._compat != self._compat:
            raise IpcError(
                f"cannot copy blocks between incompatible pools: source {src.layout.compat_fields()}"
                f", destination {self.layout.compat_fields()}"
            )
        s = src._ids(src_ids, "source")
        d = self._ids(dst_ids, "destination")
        if s.size != d.size:
            raise IpcError(f"{s.size} source block ids but {d.size} destination ids")
        if np.unique(d).size != d.size:
            raise IpcError(f"destination block ids repeat: {d.tolist()}")
        return s, d

    def _copy_few(self, src: KVPool, src_ids: list[int], dst_ids: list[int]) -> None:
        """copy_blocks_from for a few ids given as lists, between CPU pools: the same checks
        in plain Python (each a single C-level pass), where numpy's fixed costs would dominate."""
        if src._compat != self._compat:
            raise IpcError(
                f"cannot copy blocks between incompatible pools: source {src._compat}"
                f", destination {self._compat}"
            )
        n = len(dst_ids)
        if len(src_ids) != n:
            raise IpcError(f"{len(src_ids)} source block ids but {n} destination ids")
        if not n:
            return
        check_block_ids(src_ids, src.num_blocks, "source")
        check_block_ids(dst_ids, self.num_blocks, "destination", distinct=True)
        self._memmove_runs(src, _runs_small(src_ids, dst_ids))

    def _memmove_runs(self, src: KVPool, runs: list[tuple[int, int, int]]) -> None:
        """Copy (src_start, dst_start, length) runs of blocks between two distinct CPU pools
        whose ids were checked: each run is one contiguous byte range on both sides."""
        nb = self._block_nbytes
        dst, srcp = self._addr, src._addr
        for s0, d0, n in runs:
            ctypes.memmove(dst + d0 * nb, srcp + s0 * nb, n * nb)

    def _run_limit(self) -> int:
        """Most runs a CPU pull copies one by one before switching to gather + scatter."""
        return max(_MIN_RUN_LIMIT, self.layout.block_nbytes // _RUN_BYTES_BREAK_EVEN)

    def _ids(self, block_ids: BlockIds, what: str) -> np.ndarray:
        """Ids as a 1-D int64 numpy array, range-checked against this pool."""
        return block_id_array(block_ids, self.num_blocks, what)

    def __repr__(self) -> str:
        return f"KVPool({self.layout}, device={self.device})"


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of blocks adjacent in both lists: [(src_start, dst_start, length)]."""
    return _runs(np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64))


def _runs(s: np.ndarray, d: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs where both id lists step by +1: [(src_start, dst_start, length)]."""
    if s.size == 0:
        return []
    if s.size <= _SMALL:  # a few ids: plain Python is ~10x cheaper than numpy's fixed costs
        return _runs_small(s.tolist(), d.tolist())
    starts = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], starts))
    lengths = np.diff(np.concatenate((starts, [len(s)])))
    return list(zip(s[starts].tolist(), d[starts].tolist(), lengths.tolist(), strict=True))


def _runs_small(s: list[int], d: list[int]) -> list[tuple[int, int, int]]:
    """_runs for short lists (at most _SMALL ids), in plain Python."""
    if not s:
        return []
    out = []
    s0, d0, n = s[0], d[0], 1
    for a, b in zip(s[1:], d[1:], strict=True):
        if a == s0 + n and b == d0 + n:
            n += 1
        else:
            out.append((s0, d0, n))
            s0, d0, n = a, b, 1
    out.append((s0, d0, n))
    return out
