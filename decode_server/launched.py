"""The launched first step (KV_LAUNCHED, protocol v12, CUDA): the fast path's own room.

The prefill has queued the forward, the first token (into its mailbox on the GPU) and the event
slot's record, and KV_READY follows once its host has the token. A plain sequence that arrives
while nothing else is to be decoded (no step running, launched or queued) starts its pull then,
behind the slot, with the mailbox entry copied into `first_token` by the same pull, and joins
the batch: its first step is launched ahead (overlap), its input token taken from `first_token`
on the GPU, so the 2nd token does not wait for our host's work after the forward. That step's
result is read only once KV_READY has given the host the first token (`wait_firsts`), and its
RELEASE waits for KV_READY too (phase FIRST_PULLED: the prefill's phase takes none before).

DecodeRequests enters this room from one place each: `kv_launched` asks `may_launch` and
`launch_plan`, its loop calls `wait_firsts` before a step ahead is read, and KV_READY or the
sequence's end calls `arrived`. Without CUDA or overlapped steps `first_token` is None and
nothing here runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from common.daemon.runtime import ModelRuntime
from decode_server.engine import DecodeEngine
from decode_server.phase import FIRST_DUE, TRANSFER_DUE
from decode_server.sequence import Sequence

#: how long a step launched on KV_LAUNCHED waits to be read for its KV_READY (which follows the
#: prefill forward's host sync) before that sequence is failed and the batch goes on
FIRST_TOKEN_WAIT_S = 10.0


class LaunchedFirst:
    def __init__(self, rt: ModelRuntime, overlap: str) -> None:
        # where a launched sequence's pull puts its first token (one at a time: only a sequence
        # that finds nothing else to decode is launched so)
        self.first_token: torch.Tensor | None = None
        if rt.device.type == "cuda" and overlap != "off":
            self.first_token = torch.zeros(1, dtype=torch.int64, device=rt.device)
        self._known = asyncio.Event()  # a KV_READY for a launched sequence, or its end
        self._last: Sequence | None = None  # its pull writes `first_token`
        self.count = 0  # sequences whose pull and first step started on KV_LAUNCHED

    def may_launch(self, seq: Sequence, engine: DecodeEngine, stepping: bool) -> bool:
        """Whether `seq` may start on KV_LAUNCHED: plain, on a link with the prefill's mailbox
        and on our GPU (one stream order for the copy; another GPU's events are left to
        KV_READY), an event slot named, steps overlapped, and nothing else to decode (no step
        running, launched ahead or queued): its first step then waits for the prefill alone.
        And no earlier launched pull outstanding (one whose sequence ended before its step):
        it could still write `first_token` after this one's."""
        consumer, last = seq.link.consumer, self._last
        return (
            self.first_token is not None
            and seq.plain
            and seq.event_slot >= 0
            and seq.plan is not None
            and consumer is not None
            and consumer.mailbox is not None
            and consumer.shares_device
            and not stepping
            and not len(engine)
            and not engine.ahead
            and (last is None or last.phase not in TRANSFER_DUE)
        )

    def launch_plan(self, seq: Sequence) -> Any:
        """The sequence's planned pull, now also copying the mailbox entry into `first_token`,
        which its first step reads; counted, and remembered as the last one launched."""
        assert self.first_token is not None and seq.plan is not None  # may_launch said so
        seq.first_on_device = self.first_token
        self.count += 1
        self._last = seq
        return dataclasses.replace(seq.plan, first_into=self.first_token)

    def arrived(self) -> None:
        """A launched sequence's first token reached the host (KV_READY), or it ended."""
        self._known.set()

    async def wait_firsts(self, engine: DecodeEngine, fail: Callable[[Sequence], None]) -> None:
        """Before the step ahead is read: every sequence in it that was launched on KV_LAUNCHED
        has its first token on the host (KV_READY) or has ended. One whose KV_READY does not
        come within FIRST_TOKEN_WAIT_S goes to `fail` and the rest go on."""
        while pending := engine.first_pending():
            self._known.clear()
            try:
                await asyncio.wait_for(self._known.wait(), FIRST_TOKEN_WAIT_S)
            except TimeoutError:
                for seq in pending:
                    if seq.phase in FIRST_DUE:
                        fail(seq)
