"""How CacheManager reads a peer's blocks cache: its export (a REGISTER frame and fds) opened as a
KVConsumer, and a pull through that consumer completed before returning. Split out of
common/transfer/cache_manager.py, the facade, which calls only these two functions of the transfer layer's
consumer side."""

from __future__ import annotations

import torch

from common.errors import PdkvError
from common.kv.pool import KVPool, PoolLayout
from common.protocol import ErrorCode, Register, decode
from common.transfer import KVConsumer, TransferRefused
from common.transfer.regions import close_fds


def pull(link: KVConsumer, src_ids: list[int], dst_ids: list[int]) -> None:
    """The facade's one call of KVConsumer.pull (adapt here if its signature moves). The link
    has no pull stream, so the copy runs at once on the caller's current stream, ordered after
    the caller's own work; on CUDA this waits for it, so the pull is complete on return."""
    outcome: list[BaseException | None] = []
    link.pull(src_ids, dst_ids, -1, outcome.append)
    if outcome and outcome[0] is not None:
        raise outcome[0]
    if link.local.device.type == "cuda":
        torch.cuda.current_stream(link.local.device).synchronize()


def open_link(payload: bytes, fds: list[int], device: torch.device) -> KVConsumer:
    """A KVConsumer over the peer pool a REGISTER frame names. It is opened into a one-block
    landing pool of the peer's layout (a consumer needs a local pool; CacheManager names the
    real destination per pull, through `into`). Every fd not taken over is closed."""
    taken = 0

    def take(n: int) -> list[int]:
        nonlocal taken
        if n > len(fds):
            raise TransferRefused(
                ErrorCode.BAD_REQUEST, f"REGISTER names {n} fds, {len(fds)} came with it"
            )
        taken = n
        return fds[:n]

    try:
        try:
            reg = decode(payload)
            if not isinstance(reg, Register):
                raise PdkvError(f"a {type(reg).__name__} frame, not a REGISTER")
            one = PoolLayout(**{**reg.layout, "num_blocks": 1})  # type: ignore[arg-type]
        except (PdkvError, TypeError) as exc:
            raise TransferRefused(ErrorCode.BAD_REQUEST, f"not a cache export: {exc}") from None
        landing = KVPool(one, torch.empty(one.shape, dtype=one.torch_dtype, device=device))
        return KVConsumer.open(reg, take, landing)
    finally:
        close_fds(fds[taken:])  # taken ones: the mapping's, or closed by a refusing open


__all__ = ["open_link", "pull"]
