"""One client request inside the prefill daemon: its blocks, its inbox from the link, its timings."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from common.context_length import context_error
from common.errors import PdkvError
from common.model.sampling import SamplingParams
from common.protocol import ErrorCode, Generate, Message


class RequestFailed(PdkvError):
    """A request ends with an ERROR frame of `code` to its client."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class PrefillRequest:
    """Created by RequestPipeline.run; the pipeline routes the decode's answers (from the link)
    into `inbox`."""

    request_id: str
    prompt_tokens: list[int]
    sampling: SamplingParams
    stream: bool = True
    inbox: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    generated: list[int] = field(default_factory=list)
    text_tokens: int = 0  # generated tokens already turned into text for the client
    ttft_ms: float = 0.0
    first_ns: int = 0  # monotonic ns when the first token reached the loop
    handoff_sent_ns: int = 0
    kv_ready_ns: int = 0  # the frame that lets the decode read the KV sent (HANDOFF or TOKENS)
    handoff_us: float = 0.0  # that frame sent → RELEASE received
    handed_off: bool = False  # a HANDOFF went out on `link_id`
    held: bool = False  # ... and that decode may still hold the request (no ERROR/FINISH yet)
    leased: bool = False  # the blocks are leased to the link: their KV is written
    released: bool = False
    link_id: str = ""
    event_slot: int = -1  # CUDA: the ring slot recorded after this request's scatter


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
