"""One sequence in the decode daemon's batch: its blocks, tokens and sampling state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.model.sampling import SamplingParams


@dataclass(eq=False)
class Sequence:
    """A request being decoded. Owned by the decode engine; `peer` is the link it came from.

    `tokens` holds the prompt then every generated token; the KV cache holds positions
    0..len(tokens)-2 (the last token's K/V is written by the next step).
    """

    request_id: str
    peer: str
    prompt_len: int
    tokens: list[int]
    blocks: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    block_size: int
    handoff_us: float = 0.0
    pull_us: float = 0.0
    started: float = field(default_factory=time.monotonic)
    finish_reason: str | None = None

    @property
    def key(self) -> str:
        """Unique across links: request ids are only unique per prefill daemon."""
        return f"{self.peer}/{self.request_id}"

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def position(self) -> int:
        """Position of the last token, whose K/V the next step writes."""
        return len(self.tokens) - 1

    def slot(self) -> int:
        pos = self.position
        return self.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def check_finished(self) -> str | None:
        """Set and return the finish reason after a token was appended, or None."""
        if not self.sampling.ignore_eos and self.tokens[-1] in self.stop_ids:
            self.finish_reason = "stop"
        elif self.generated >= self.sampling.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason


def blocks_needed(prompt_len: int, max_tokens: int, block_size: int) -> int:
    """Blocks a sequence needs for its whole life: K/V of prompt + all but the last generated token."""
    positions = prompt_len + max_tokens - 1
    return -(-positions // block_size)
