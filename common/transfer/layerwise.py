"""A block transfer paced layer by layer, in the background: what CacheManager.transfer_cache_async
runs (a transfer that overlaps the producer's forward pass, as LLM-DataDist's does)."""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from common.errors import IpcError
from common.kv.blockids import block_id_array
from common.kv.pool import KVPool


class LayerSynchronizer(Protocol):
    """Paces a layer-wise transfer: `synchronize_layer(i)` returns once layer i of the source may
    be read (e.g. the producer's forward pass has written it), False on timeout."""

    def synchronize_layer(self, layer_index: int, timeout_s: float) -> bool: ...


class TransferTask:
    """A transfer running in the background; `synchronize()` waits and re-raises its error."""

    def __init__(self, run) -> None:  # type: ignore[no-untyped-def]
        self._error: BaseException | None = None
        self.layers_done = 0

        def body() -> None:
            try:
                run(self)
            except BaseException as exc:  # handed to synchronize()
                self._error = exc

        self._thread = threading.Thread(target=body, name="pdkv-transfer", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Block until the transfer ends; TimeoutError if it is still running after timeout_s."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"transfer still running after {timeout_s} s")
        if self._error is not None:
            raise self._error


def start_layerwise(
    s_pool: KVPool,
    d_pool: KVPool,
    src_ids: list[int],
    dst_ids: list[int],
    layer_sync: LayerSynchronizer,
    timeout_s: float,
) -> TransferTask:
    """Copy the blocks layer by layer on a thread, each layer once `layer_sync` allowed it."""
    if s_pool.layout.compat_fields() != d_pool.layout.compat_fields():
        raise IpcError("caches of different layouts cannot exchange blocks")
    s_ids = block_id_array(src_ids, s_pool.num_blocks, "source")
    d_ids = block_id_array(dst_ids, d_pool.num_blocks, "destination")
    if s_ids.size != d_ids.size:
        raise IpcError(f"{s_ids.size} source block ids but {d_ids.size} destination ids")
    s_idx = torch.from_numpy(s_ids).to(s_pool.device)
    d_idx = torch.from_numpy(d_ids).to(d_pool.device)

    def run(task: TransferTask) -> None:
        for layer in range(s_pool.layout.num_layers):
            if not layer_sync.synchronize_layer(layer, timeout_s):
                raise TimeoutError(f"layer {layer} was not ready within {timeout_s} s")
            picked = s_pool.tensor[:, layer].index_select(0, s_idx)
            d_pool.tensor[:, layer].index_copy_(0, d_idx, picked.to(d_pool.device))
            if d_pool.device.type == "cuda":
                torch.cuda.current_stream(d_pool.device).synchronize()
            task.layers_done = layer + 1

    return TransferTask(run)


__all__ = ["LayerSynchronizer", "TransferTask", "start_layerwise"]
