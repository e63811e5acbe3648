"""One request in the decode daemon: its phase, blocks, tokens, sampling state and timing marks."""

from __future__ import annotations

import collections.abc as abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.model.logits import TokenHistory
from common.model.paged import blocks_for, slot_of
from common.model.sampling import SamplingParams, finish_reason
from common.sampling_params import TokenLogprob
from common.timings import Marks
from decode_server.phase import Phase

if TYPE_CHECKING:
    from common.transfer.interface import PullPlan
    from decode_server.grammars import SequenceGrammar
    from decode_server.peer import Peer


@dataclass(eq=False, slots=True)
class Sequence:
    """A request in the decode daemon, from its HANDOFF until its blocks are freed. `link` is
    the prefill it came from; `phase` says where it is (decode_server/phase.py), moved only by
    DecodeRequests through the phase table.

    `generated` holds every generated token (the prefill's first one included); the KV cache
    holds positions 0..position-1, and the next step writes the K/V of the last token at
    `position`. The prompt itself is kept only when a repetition_penalty reads it: otherwise
    after the pull only its length matters.
    """

    request_id: str
    link: Peer
    prompt_len: int
    generated: list[int]
    blocks: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    block_size: int
    event_slot: int = -1  # the HANDOFF's, echoed in RELEASE
    phase: Phase = Phase.NEW
    plan: PullPlan | None = None  # AWAITING_KV/_READY: the pull prepared ahead of its KV_READY
    marks: Marks = field(default_factory=Marks)  # decode_server.timings names them
    steps: int = 0  # decode steps it has been in
    later_step_ns: int = 0  # torch-thread time of its steps after the first, summed
    finish_reason: str | None = None
    error: str | None = None  # set when this sequence alone failed (non-finite logits, sampler)
    # CUDA: the event recorded after this sequence's pull (KVConsumer.pull); the first step that
    # reads its blocks makes the compute stream wait on it, then clears it. None: nothing to wait.
    ready: Any = None
    names: abc.Sequence[bytes] = field(
        default_factory=list
    )  # its full prompt blocks' prefix-cache names
    cached_blocks: int = 0  # leading prompt blocks reused from the prefix cache: not pulled
    # the prompt, kept only when its repetition_penalty reads it (else empty)
    prompt: list[int] = field(default_factory=list)
    history: TokenHistory | None = None  # penalized: built by its first step (torch thread)
    last_logprob: TokenLogprob | None = None  # its last step's token's, when it asks for them
    # v12, started on KV_LAUNCHED (launched.py): the device int64 [1] its pull copies the first
    # token into, read by its first step's launch
    first_on_device: Any = None
    # its blocks past the prompt's full ones, named as they fill, for the host KV tier
    # (common/kv/tier_io.Conversation); None: the tier is off
    tier: Any = None
    # its structured output's matcher (decode_server/grammars.py); None: unconstrained
    grammar: SequenceGrammar | None = None
    # unique across links (request ids are only unique per prefill daemon): seq_key, made once
    key: str = field(init=False)
    # greedy, no penalty, no min_tokens, no logprobs, no grammar: its token is the argmax of the
    # raw logits,
    # so a step of such sequences only skips the draw's per-sequence work (DecodeEngine._draw)
    plain: bool = field(init=False)
    # plain, or greedy under a grammar with nothing else to process or report: it may run in a
    # step launched ahead (decode_server/ahead.py masks its row before the token is carried)
    steps_ahead: bool = field(init=False)

    def __post_init__(self) -> None:
        self.key = seq_key(self.link.link_id, self.request_id)
        p = self.sampling
        self.plain = (
            p.greedy
            and not p.penalized
            and p.min_tokens == 0
            and p.logprobs is None
            and p.structured is None
        )
        self.steps_ahead = self.plain or (
            p.greedy and not p.penalized and p.min_tokens == 0 and p.logprobs is None
        )

    @property
    def position(self) -> int:
        """Position of the last token, whose K/V the next step writes."""
        return self.prompt_len + len(self.generated) - 1

    def slot(self) -> int:
        """Slot the next step writes the last token's K/V into."""
        return slot_of(self.blocks, self.position, self.block_size)

    def check_finished(self) -> str | None:
        """Set and return the finish reason after a token was appended, or None (the rule is
        the reference's own, so both stop at the same token; a grammar whose text is complete
        ends the sequence, "stop")."""
        if self.grammar is not None:
            self.grammar.catch_up(self.generated)
            if self.grammar.done:
                self.finish_reason = "stop"
                return self.finish_reason
        self.finish_reason = finish_reason(self.generated, self.sampling, self.stop_ids)
        return self.finish_reason


def blocks_needed(prompt_len: int, max_tokens: int, block_size: int) -> int:
    """Blocks a sequence needs for its whole life: K/V of prompt + all but the last generated token."""
    return blocks_for(prompt_len + max_tokens - 1, block_size)


def seq_key(link_id: str, request_id: str) -> str:
    """A sequence's key in the decode: request ids are only unique per prefill daemon (link)."""
    return f"{link_id}/{request_id}"
