"""Block copy between KV pools: the CUDA kernel when the extension is built, torch otherwise.

`copy_blocks(dst, src, dst_ids, src_ids)` copies block src_ids[i] of `src` into block dst_ids[i]
of `dst`. Pools are block-major and contiguous, shape (num_blocks, ...), so one block is one
contiguous byte range. On CUDA the copy is one kernel launch per 480 blocks on `stream` (the dst
device's current stream by default), the ids passed as launch parameters, 16-byte vector loads; `src` may live on a peer GPU (an imported pool), in which
case peer access is enabled once. Otherwise (CPU, or no extension) it is one torch index_copy_.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.cuda import cuda_errors, ext, has_extension, stream_ptr
from common.errors import IpcError
from common.kv.blockids import block_id_array

_PEERS: set[tuple[int, int]] = set()


def _check(dst: torch.Tensor, src: torch.Tensor, n_dst: int, n_src: int) -> None:
    if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
        raise IpcError(
            f"pools differ: dst {dst.dtype} {tuple(dst.shape)} vs src {src.dtype} "
            f"{tuple(src.shape)}; block shape and dtype must match"
        )
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise IpcError(
            f"pools must be block-major contiguous: dst strides {dst.stride()}, "
            f"src strides {src.stride()}"
        )
    if n_dst != n_src:
        raise IpcError(f"{n_dst} dst ids for {n_src} src ids; pass one dst block per src block")


def _ids(ids: Sequence[int] | torch.Tensor, limit: int, what: str) -> torch.Tensor:
    return torch.from_numpy(block_id_array(ids, limit, what))


def copy_blocks(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_ids: Sequence[int] | torch.Tensor,
    src_ids: Sequence[int] | torch.Tensor,
    stream: torch.cuda.Stream | int | None = None,
) -> None:
    """Copy src[src_ids[i]] into dst[dst_ids[i]] for every i.

    Asynchronous on CUDA (ordered on `stream`, default the dst device's current stream); the
    caller synchronizes or records an event. IpcError for mismatched pools or ids out of range.
    The kernel runs on dst's GPU and reads a src on another GPU over peer access; memory imported
    from another process must then be mapped in dst's context (CudaRawRegion.open_for): a GPU
    cannot read an IPC mapping made in another GPU's context (illegal address on two H200s).
    """
    d_ids = _ids(dst_ids, dst.shape[0], "dst")
    s_ids = _ids(src_ids, src.shape[0], "src")
    _check(dst, src, d_ids.numel(), s_ids.numel())
    copy_checked_blocks(dst, src, d_ids, s_ids, stream)


def copy_checked_blocks(
    dst: torch.Tensor,
    src: torch.Tensor,
    d_ids: torch.Tensor,
    s_ids: torch.Tensor,
    stream: torch.cuda.Stream | int | None = None,
) -> None:
    """copy_blocks for a caller that has checked everything already (KVPool.copy_blocks_from):
    pools of one block shape and dtype, contiguous; ids as equally long 1-D int64 CPU tensors,
    in range. Nothing is checked again here."""
    if d_ids.numel() == 0:
        return
    if dst.is_cuda and src.is_cuda and has_extension():
        _copy_cuda(dst, src, d_ids, s_ids, stream)
        return
    if dst.is_cuda and stream is not None and not isinstance(stream, int):
        with torch.cuda.stream(stream):
            dst.index_copy_(0, ids_on(d_ids, dst.device), gather_after(src, s_ids, dst.device))
        return
    dst.index_copy_(0, ids_on(d_ids, dst.device), gather_after(src, s_ids, dst.device))


def ids_on(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CPU int64 ids on `device`; to a GPU through pinned memory, without a host wait (a pageable
    upload synchronizes its stream, and a pull's stream waits on the producer's event)."""
    if device.type != "cuda":
        return ids
    return ids.pin_memory().to(device, non_blocking=True)


def gather_after(src: torch.Tensor, s_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """src[s_ids] on `device`, ordered after `device`'s current stream (where the caller put
    the wait on the producer's event). From another GPU the gather runs on that GPU's current
    stream, so that stream first waits on ours; torch's cross-device copy then makes ours wait
    on the gather before anything after it on our stream reads the result."""
    if src.is_cuda and device.type == "cuda" and src.device != device:
        torch.cuda.current_stream(src.device).wait_stream(torch.cuda.current_stream(device))
    return src.index_select(0, ids_on(s_ids, src.device)).to(device)


def _copy_cuda(
    dst: torch.Tensor,
    src: torch.Tensor,
    d_ids: torch.Tensor,
    s_ids: torch.Tensor,
    stream: torch.cuda.Stream | int | None,
) -> None:
    copy_ids_cuda(dst, src, s_ids.numpy(), d_ids.numpy(), stream)


@dataclass(frozen=True, slots=True)
class KernelCopy:
    """One checked pull between two pools on one GPU, ready to launch: what `copy_ids_cuda`
    works out per call (pointers, block size, id arrays), done ahead of time, so `launch` is
    the kernel's enqueue and nothing else (the decode plans an early HANDOFF's pull while the
    prefill computes, and launches it when the first token says the KV is written)."""

    dst_ptr: int
    src_ptr: int
    src_ids: np.ndarray | list[int]
    dst_ids: np.ndarray | list[int]
    block_nbytes: int
    device: int

    @classmethod
    def between(
        cls,
        dst: torch.Tensor,
        src: torch.Tensor,
        s_ids: np.ndarray | list[int],
        d_ids: np.ndarray | list[int],
    ) -> KernelCopy:
        """For checked pools and checked int64 ids; the kernel runs on dst's GPU."""
        nbytes = math.prod(dst.shape[1:]) * dst.element_size()
        return cls(dst.data_ptr(), src.data_ptr(), s_ids, d_ids, nbytes, dst.device.index)

    def launch(self, stream: torch.cuda.Stream | int | None) -> None:
        """Enqueue the copy on `stream` (IpcError/CudaError if the launch fails)."""
        with cuda_errors():
            ext().copy_blocks(
                self.dst_ptr,
                self.src_ptr,
                self.src_ids,
                self.dst_ids,
                self.block_nbytes,
                stream_ptr(stream, self.device),
                self.device,
            )


def copy_ids_cuda(
    dst: torch.Tensor,
    src: torch.Tensor,
    s_ids: np.ndarray | list[int],
    d_ids: np.ndarray | list[int],
    stream: torch.cuda.Stream | int | None,
) -> None:
    """The kernel launch itself, for checked pools and ids (host int64 arrays or lists of ints,
    in range): the ids go to the GPU as launch parameters, so this enqueues one launch per 480
    blocks and nothing else — no id buffer to upload, pin or keep alive (a pull's host cost)."""
    device = dst.device.index
    peer = src.device.index
    if peer != device and (device, peer) not in _PEERS:
        with cuda_errors():
            ext().enable_peer_access(device, peer)
        _PEERS.add((device, peer))
    KernelCopy.between(dst, src, s_ids, d_ids).launch(stream)
