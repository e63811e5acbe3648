"""Block-id checks, in one place: every pull, copy and HANDOFF validates ids through here.

Two forms of one rule (ids are ints in [0, limit), distinct where a destination needs it):
`check_block_ids` for short Python lists (plain Python, each check one C-level pass: the
handoff's common case costs a few µs), and `block_id_array` for anything else (tensors, long
lists), which returns the ids as an int64 numpy array. Both raise IpcError naming the bad ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from common.errors import IpcError

BlockIds = Sequence[int] | torch.Tensor


def _out_of_range(bad: list[int], limit: int, what: str) -> IpcError:
    return IpcError(f"{what} block ids {bad[:8]} out of range [0, {limit}) for this pool")


def check_block_ids(ids: list[int], limit: int, what: str, *, distinct: bool = False) -> None:
    """Ids as a flat list of ints in [0, limit) (and pairwise distinct if `distinct`)."""
    if not ids:
        return
    if set(map(type, ids)) != {int}:
        raise IpcError(f"{what} block ids must be ints in a flat list, got {ids!r:.80}")
    if min(ids) < 0 or max(ids) >= limit:
        raise _out_of_range([i for i in ids if not 0 <= i < limit], limit, what)
    if distinct and len(set(ids)) != len(ids):
        raise IpcError(f"{what} block ids repeat: {ids!r:.200}")


def block_id_array(ids: BlockIds, limit: int, what: str, *, distinct: bool = False) -> np.ndarray:
    """Ids as a 1-D int64 numpy array, range-checked against `limit`.

    numpy rather than torch: on a handful of ids each torch op costs ~10 µs, numpy's ~1 µs.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise IpcError(f"{what} block ids must be integers, got {ids.dtype}")
        arr = ids.detach().to("cpu", torch.int64).reshape(-1).numpy()
    else:
        try:
            arr = np.asarray(list(ids))
        except (TypeError, ValueError) as exc:
            raise IpcError(f"{what} block ids must be ints: {exc}") from None
        if arr.size and (arr.dtype.kind not in "iu" or arr.ndim != 1):
            raise IpcError(f"{what} block ids must be ints in a flat list, got {arr.dtype}")
        arr = arr.astype(np.int64, copy=False).reshape(-1)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limit):
        raise _out_of_range(arr[(arr < 0) | (arr >= limit)].tolist(), limit, what)
    if distinct and np.unique(arr).size != arr.size:
        raise IpcError(f"{what} block ids repeat: {arr.tolist()[:64]}")
    return arr
