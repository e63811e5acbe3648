"""One client request inside the prefill daemon: its phase, blocks, inbox from the link, its
client (for the direct relay), marks."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.context_length import context_error
from common.errors import PdkvError
from common.model.detokenizer import TextStream
from common.model.sampling import SamplingParams
from common.protocol import ErrorCode, Generate, Message, Tokens, join_queued
from common.timings import Marks
from prefill_server.phase import Event, Phase, accepts, next_phase


class RequestFailed(PdkvError):
    """A request ends with an ERROR frame of `code` to its client."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ClientSink(Protocol):
    """Where a request's frames may go without its task: its client connection's ClientWriter
    (prefill_server.client_writer), given to RequestPipeline.run by the server."""

    def can_send_now(self) -> bool:
        """True if a frame may be queued now without waiting for the client or failing."""

    def send_nowait(self, msg: Message) -> None:
        """Queue `msg` behind every frame queued before it; only after `can_send_now`."""


@dataclass(eq=False)
class PrefillRequest:
    """Created by RequestPipeline.run; the pipeline routes the decode's answers (from the link)
    into `inbox`, except the TOKENS it relays from the link's read callback straight to `sink`
    while `waiting` (prefill_server/relay.py). Its life is `phase` (prefill_server.phase),
    moved only by `advance`, for every frame either way.

    Marks (monotonic ns, `marks`): arrived, first_token (on the loop), handoff_sent (the last
    HANDOFF), kv_offered (the frame that lets the decode read the KV: HANDOFF with the first
    token, or KV_READY), released (RELEASE received), finished (FINISH to the client)."""

    request_id: str
    prompt_tokens: list[int]
    sampling: SamplingParams
    stream: bool = True
    phase: Phase = Phase.ADMITTED
    inbox: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)
    marks: Marks = field(default_factory=Marks)
    blocks: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    text_tokens: int = 0  # generated tokens already turned into text for the client
    text: TextStream | None = None  # its incremental detokenizer, once it streams text
    link_id: str = ""  # the link the HANDOFF went out on
    event_slot: int = -1  # CUDA: the ring slot recorded after this request's scatter
    names: Sequence[bytes] = field(default_factory=list)  # its full blocks' prefix-cache names
    cached_tokens: int = 0  # leading prompt tokens whose K/V came from the prefix cache
    sink: ClientSink | None = None  # its client; None: every frame goes through its task
    # its task while it waits in the relay for its inbox, every frame before sent (else None)
    waiting: asyncio.Task[Any] | None = None
    direct_frames: int = 0  # the decode's TOKENS relayed from the read callback, not the inbox

    def __post_init__(self) -> None:
        self.marks.stamp("arrived")

    def advance(self, event: Event) -> Phase:
        """Move to the phase `event` leads to and return it; IllegalEvent (phase unchanged) if
        it cannot happen in this one."""
        self.phase = next_phase(self.request_id, self.phase, event)
        return self.phase

    def more_tokens(self, msg: Tokens) -> tuple[Tokens, Message | None]:
        """`msg` with the TOKENS queued behind it in the inbox, as one (`join_queued`), and the
        frame taken after them that is not one of them (None if none was). Under load the
        decode's steps reach the inbox faster than the request's task relays them; taken
        together they cost one relay, one text delta and one frame to the client instead of one
        each."""
        return join_queued(msg, self.inbox)

    def accepts(self, event: Event) -> bool:
        """True if `event` may happen in the request's phase."""
        return accepts(self.phase, event)


def prompt_tokens(
    msg: Generate, tokenizer: Any, vocab_size: int, limit: int, *, max_positions: int
) -> list[int]:
    """The prompt of a GENERATE as token ids: exactly one of prompt or prompt_tokens, not empty,
    1..limit tokens, every id < vocab_size, and with max_tokens within the model's
    `max_positions`; RequestFailed(BAD_REQUEST) naming what is wrong otherwise."""
    if (msg.prompt is None) == (msg.prompt_tokens is None):
        raise RequestFailed(ErrorCode.BAD_REQUEST, "give exactly one of prompt or prompt_tokens")
    if not (msg.prompt or msg.prompt_tokens):  # "" would still encode to BOS alone
        raise RequestFailed(ErrorCode.BAD_REQUEST, "the prompt is empty")
    tokens = tokenizer.encode(msg.prompt) if msg.prompt is not None else msg.prompt_tokens
    if not tokens:
        raise RequestFailed(ErrorCode.BAD_REQUEST, "the prompt encodes to no tokens")
    if len(tokens) > limit:
        raise RequestFailed(
            ErrorCode.BAD_REQUEST,
            f"prompt has {len(tokens)} tokens, more than the {limit} allowed "
            "(--max-prompt-tokens of the prefill daemon)",
        )
    if max(tokens) >= vocab_size:
        raise RequestFailed(ErrorCode.BAD_REQUEST, f"token id {max(tokens)} >= vocab {vocab_size}")
    if why := context_error(len(tokens), msg.sampling.max_tokens, max_positions):
        raise RequestFailed(ErrorCode.BAD_REQUEST, why)
    return list(tokens)
