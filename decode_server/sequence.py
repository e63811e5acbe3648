"""One sequence in the decode daemon's batch: its blocks, tokens and sampling state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from common.model.paged import blocks_for, slot_of
from common.model.sampling import SamplingParams, finish_reason


@dataclass(eq=False, slots=True)
class Sequence:
    """A request being decoded. Owned by the decode engine; `peer` is the link it came from.

    `generated` holds every generated token (the prefill's first one included); the KV cache
    holds positions 0..position-1, and the next step writes the K/V of the last token at
    `position`. The prompt itself is not kept: after the pull only its length matters.
    """

    request_id: str
    peer: str
    prompt_len: int
    generated: list[int]
    blocks: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    block_size: int
    handoff_us: float = 0.0
    pull_us: float = 0.0
    usable_us: float = 0.0  # HANDOFF sent -> its pull enqueued and the sequence in the batch
    started: float = field(default_factory=time.monotonic)  # admitted; then its pull started
    first_step_us: float = 0.0  # its pull started (`started`) -> its first decoded token posted
    # the HANDOFF's way in: read_us (sent -> handed to DecodeRequests; of it wire_us: sent -> the
    # bytes read), admit_us (checked, blocks reserved), enqueue_us (pull started, in the batch);
    # its first step (engine.py): join_us (in the batch -> the step starts on the torch thread),
    # first_launch_us (-> every kernel queued), first_sync_us (-> its token on the host)
    stages_us: dict[str, float] = field(default_factory=dict)
    joined_ns: int = 0  # monotonic ns when it was added to the engine
    steps: int = 0  # decode steps it has been in
    later_step_ns: int = 0  # torch-thread time of its steps after the first, summed
    finish_reason: str | None = None
    error: str | None = None  # set when this sequence alone failed (non-finite logits, sampler)
    # CUDA: the event recorded after this sequence's pull (KVConsumer.pull); the first step that
    # reads its blocks makes the compute stream wait on it, then clears it. None: nothing to wait.
    ready: Any = None

    @property
    def key(self) -> str:
        """Unique across links: request ids are only unique per prefill daemon."""
        return seq_key(self.peer, self.request_id)

    @property
    def position(self) -> int:
        """Position of the last token, whose K/V the next step writes."""
        return self.prompt_len + len(self.generated) - 1

    def slot(self) -> int:
        """Slot the next step writes the last token's K/V into."""
        return slot_of(self.blocks, self.position, self.block_size)

    def check_finished(self) -> str | None:
        """Set and return the finish reason after a token was appended, or None (the rule is
        the reference's own, so both stop at the same token)."""
        self.finish_reason = finish_reason(self.generated, self.sampling, self.stop_ids)
        return self.finish_reason


def blocks_needed(prompt_len: int, max_tokens: int, block_size: int) -> int:
    """Blocks a sequence needs for its whole life: K/V of prompt + all but the last generated token."""
    return blocks_for(prompt_len + max_tokens - 1, block_size)


def seq_key(link_id: str, request_id: str) -> str:
    """A sequence's key in the decode: request ids are only unique per prefill daemon (link)."""
    return f"{link_id}/{request_id}"
