"""The pull: copy a HANDOFF's blocks from the peer's imported pool into ours.

CPU: a plain copy on the loop thread (a few KiB to MiB of memcpy; the frame was the signal).
CUDA: the pull stream waits on the peer's event slot (the GPU waits, not the CPU), the block copy
kernel runs on that stream, and a local event recorded after it is polled from the loop, so the
loop never blocks; RELEASE goes out only once that event has completed.
"""

from __future__ import annotations

import asyncio

import torch

from common.blockcopy import copy_blocks
from common.modelrt import ModelRuntime
from decode_server.peer import Peer


class Puller:
    def __init__(self, rt: ModelRuntime) -> None:
        self.rt = rt
        self.cuda = rt.device.type == "cuda"
        self.stream = None
        if self.cuda:
            torch.cuda.set_device(rt.device)  # the loop thread launches the pulls
            self.stream = torch.cuda.Stream(rt.device)

    async def pull(self, peer: Peer, src_ids: list[int], dst_ids: list[int], slot: int) -> None:
        """Copy src_ids of the peer pool into dst_ids of ours; returns once the copy is complete."""
        assert peer.pool is not None
        if not self.cuda:
            self.rt.pool.copy_blocks_from(peer.pool, src_ids, dst_ids)
            return
        if slot >= 0 and peer.events is not None:
            peer.events.wait(slot, self.stream)
        src = peer.pool.tensor
        if src.device == self.rt.device:  # cuda-raw maps the peer pool in our context
            copy_blocks(self.rt.pool.tensor, src, dst_ids, src_ids, self.stream)
        else:  # cuda-torch maps it in the owner GPU's context: torch's peer copy reads it
            with torch.cuda.stream(self.stream):
                picked = src.index_select(0, torch.tensor(src_ids, device=src.device))
                self.rt.pool.tensor.index_copy_(
                    0, torch.tensor(dst_ids, device=self.rt.device), picked.to(self.rt.device)
                )
        done = torch.cuda.Event()
        done.record(self.stream)
        await wait_event(done)


async def wait_event(event: torch.cuda.Event) -> None:
    """Await a CUDA event without blocking the loop: poll, yielding, then back off to 200 µs."""
    spins = 0
    while not event.query():
        spins += 1
        await asyncio.sleep(0 if spins < 64 else 0.0002)
