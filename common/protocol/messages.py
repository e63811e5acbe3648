"""Every message of the wire protocol as a typed, validated class; one class per direction.

Metadata travels as JSON (msgspec, unknown fields refused). Fields typed `bytes` named
`mem_handles` / `event_handles` do not travel in the JSON: the frame carries them as its binary
segments (see frame.py). Directions: P = prefill daemon, D = decode daemon, C = client. The
building blocks are in wire_types.py and the link's set-up messages in link_setup.py; this module
holds the others and the catalogue (ALL_MESSAGES, BY_TYPE); common.protocol exports them all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import msgspec

from common.protocol.link_setup import Hello, HelloOk, Register, Registered
from common.protocol.wire_types import (
    ErrorCode,
    Message,
    MsgType,
    NonNeg,
    RequestId,
    TokenId,
)
from common.sampling_params import SamplingParams, TokenLogprob

#: Most logprob entries one TOKENS frame carries in `logprobs` and in `prompt_logprobs` (a long
#: prompt's logprobs go in several frames: 512 entries of 20 alternatives are ~270 KB of JSON).
MAX_LOGPROBS_PER_FRAME = 512
LogprobList = Annotated[list[TokenLogprob], msgspec.Meta(max_length=MAX_LOGPROBS_PER_FRAME)]


class Push(Message, frozen=True):
    """D → P (v3, push links): WRITE your blocks `src_ids` into my blocks `dst_ids` with NIXL and
    notify me with `tag` (the notification's bytes are `pdkv-push:<tag>`). Sent for a HANDOFF
    once the decode has allocated its blocks; the RELEASE follows the notification as usual.
    `request_id` (v11): the HANDOFF's; after an early HANDOFF P holds the PUSH until the KV is
    written (it leases the blocks and sends KV_READY), and drops it if the request ends first."""

    TYPE = MsgType.PUSH
    tag: NonNeg
    src_ids: list[NonNeg]
    dst_ids: list[NonNeg]
    request_id: RequestId | None = None


class PushFailed(Message, frozen=True):
    """P → D (v3): the WRITE of push `tag` failed or could not start; that request fails."""

    TYPE = MsgType.PUSH_FAILED
    tag: NonNeg
    message: str


class Handoff(Message, frozen=True):
    """P → D, per request: the prompt's KV is in `block_ids` of the registered pool.

    `event_slot` is the ring slot recorded after the scatter (-1 on CPU: the frame is the signal).
    `first_token` null (v4, Unix-socket links): the early handoff, sent when the prompt is queued
    for its forward; the blocks are not written yet, and may be read only once KV_READY (v5)
    brings the first token.
    `sent_ns` is the sender's CLOCK_MONOTONIC (same host), for handoff latency.
    """

    TYPE = MsgType.HANDOFF
    request_id: RequestId
    block_ids: list[NonNeg]
    num_tokens: NonNeg
    prompt_tokens: list[TokenId]
    first_token: TokenId | None
    sampling: SamplingParams
    event_slot: Annotated[int, msgspec.Meta(ge=-1)] = -1
    sent_ns: NonNeg = 0


class Release(Message, frozen=True):
    """D → P: the blocks of `request_id` are copied (and event_slot waited on): free them."""

    TYPE = MsgType.RELEASE
    request_id: RequestId
    event_slot: Annotated[int, msgspec.Meta(ge=-1)] = -1


class KvReady(Message, frozen=True):
    """P → D (v5), after an early HANDOFF: the request's KV is written (its event slot recorded),
    and `first_token` is the token P sampled from the prefill logits. D may start the pull now.
    `sent_ns` is P's CLOCK_MONOTONIC at send (same host), for handoff latency."""

    TYPE = MsgType.KV_READY
    request_id: RequestId
    first_token: TokenId
    sent_ns: NonNeg = 0


class KvLaunched(Message, frozen=True):
    """P → D (v12), after an early HANDOFF of a plain greedy request on a Unix-socket CUDA link:
    its forward, its first token (the argmax, into the mailbox entry of its event slot: REGISTER's
    `mailbox_block`) and the record of its event slot are queued on P's GPU, not done. D may
    queue its pull behind the slot and a first step that reads the token on the GPU; KV_READY
    (or ABORT) still follows. From this frame on P holds the blocks leased and an ABORT is
    answered as after KV_READY. `sent_ns`: P's CLOCK_MONOTONIC at send (same host)."""

    TYPE = MsgType.KV_LAUNCHED
    request_id: RequestId
    sent_ns: NonNeg = 0


class Tokens(Message, frozen=True):
    """D → P → C: new tokens of a request, in order. `text` is filled by P for its client.

    v6: `logprobs`, when the request's sampling asks for them, holds one entry per token of
    `tokens`, in order. `prompt_logprobs` (P → C only, before the first token's TOKENS, `tokens`
    empty) holds the logprobs of prompt tokens 1.. in order, split over as many frames as needed;
    the client concatenates them."""

    TYPE = MsgType.TOKENS
    request_id: RequestId
    tokens: list[TokenId]
    text: str = ""
    logprobs: LogprobList | None = None
    prompt_logprobs: LogprobList | None = None

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.tokens):
            raise ValueError(  # msgspec's decode reports it as a ValidationError
                f"TOKENS has {len(self.tokens)} tokens but {len(self.logprobs)} logprobs"
            )


def join_queued(first: Tokens, queue: Any) -> tuple[Tokens, Any]:
    """`first` and the TOKENS of its request queued right behind it in `queue` (an
    asyncio.Queue: `empty`, `get_nowait`) as one message: their tokens, text and logprobs joined
    in order, at most MAX_LOGPROBS_PER_FRAME tokens; a frame with logprobs and one without, and
    prompt-logprob frames, stay apart. Also the first item taken that did not join (None if the
    queue ran dry first). A reader behind its frames (the prefill relaying a request's decode
    steps, a client reading its stream) then handles one message instead of one per frame."""
    tokens, text, lps, nxt = first.tokens, first.text, first.logprobs, None
    if first.prompt_logprobs is not None:
        return first, None
    while not queue.empty():
        nxt = queue.get_nowait()
        if (
            not isinstance(nxt, Tokens)
            or (nxt.logprobs is None) != (lps is None)
            or nxt.prompt_logprobs is not None
            or len(tokens) + len(nxt.tokens) > MAX_LOGPROBS_PER_FRAME
        ):
            break
        tokens = tokens + nxt.tokens
        text += nxt.text
        if lps is not None:
            lps = lps + nxt.logprobs  # type: ignore[operator]
        nxt = None
    if tokens is first.tokens:
        return first, nxt
    return Tokens(request_id=first.request_id, tokens=tokens, text=text, logprobs=lps), nxt


class Usage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompt_tokens: NonNeg
    completion_tokens: NonNeg
    cached_tokens: NonNeg = 0  # of prompt_tokens, those whose K/V came from the prefix cache (v8)


class Finish(Message, frozen=True):
    """D → P → C: the request is done. reason: "stop" (EOS), "length" (max_tokens), "abort"."""

    TYPE = MsgType.FINISH
    request_id: RequestId
    reason: str
    usage: Usage
    timings: dict[str, float] = {}
    text: str = ""
    # v9, P → C: the link the request was handed to (link-N@DECODE: the decode daemon's address),
    # "" when it was not handed off (or on D → P)
    decode: Annotated[str, msgspec.Meta(max_length=4096)] = ""


#: Most sequences one STEP_TOKENS frame carries (a step of more goes in several frames): 512
#: entries of 128-character ids (each character escaped), 20 logprob alternatives and a FINISH
#: each stay under 2.5 MB of JSON, in MAX_META_BYTES.
MAX_STEP_ENTRIES = 512


class StepTokens(Message, frozen=True):
    """D → P (v10): one decode step's new tokens for the sequences of one link, in one frame.

    Entry i is token `tokens[i]` of `request_ids[i]`, with `logprobs[i]` when that request asks
    for them (null for one that does not; the whole list null when none does). `finishes` are
    the FINISH of each request this step finished; each follows its request's token. P takes
    the frame as the TOKENS of its entries in order, then the FINISHes (`frames`): per request
    the order is that of separate frames."""

    TYPE = MsgType.STEP_TOKENS
    request_ids: Annotated[list[RequestId], msgspec.Meta(max_length=MAX_STEP_ENTRIES)]
    tokens: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STEP_ENTRIES)]
    logprobs: (
        Annotated[list[TokenLogprob | None], msgspec.Meta(max_length=MAX_STEP_ENTRIES)] | None
    ) = None
    finishes: Annotated[list[Finish], msgspec.Meta(max_length=MAX_STEP_ENTRIES)] = []

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if len(self.tokens) != n or (self.logprobs is not None and len(self.logprobs) != n):
            lps = "no" if self.logprobs is None else len(self.logprobs)
            raise ValueError(  # msgspec's decode reports it as a ValidationError
                f"STEP_TOKENS has {n} request ids, {len(self.tokens)} tokens, {lps} logprobs"
            )

    def frames(self) -> Iterator[Tokens | Finish]:
        """The frame as the TOKENS (one token each) and FINISH frames it stands for, in order."""
        lps = self.logprobs
        for i, (rid, tok) in enumerate(zip(self.request_ids, self.tokens, strict=True)):
            lp = None if lps is None else lps[i]
            yield Tokens(request_id=rid, tokens=[tok], logprobs=None if lp is None else [lp])
        yield from self.finishes


class Abort(Message, frozen=True):
    """P → D (or C → P): stop generating `request_id`; its blocks are freed."""

    TYPE = MsgType.ABORT
    request_id: RequestId


class Error(Message, frozen=True):
    """Any direction. `request_id` None means the connection itself is at fault."""

    TYPE = MsgType.ERROR
    code: ErrorCode
    message: str
    request_id: RequestId | None = None


#: ERROR messages are cut to this many characters: an exception's text can be any size.
MAX_ERROR_TEXT = 2000


def make_error(code: ErrorCode, message: str, request_id: str | None = None) -> Error:
    """An ERROR with `message` cut to MAX_ERROR_TEXT characters."""
    if len(message) > MAX_ERROR_TEXT:
        message = message[: MAX_ERROR_TEXT - 3] + "..."
    return Error(code=code, message=message, request_id=request_id)


class Ping(Message, frozen=True):
    TYPE = MsgType.PING
    seq: NonNeg
    sent_ns: NonNeg = 0


class Pong(Message, frozen=True):
    """D → P: the answer to PING, with the decode's load when it sent it (v6): its free KV
    blocks (-1: not reported) and its sequences in flight, from every prefill linked to it."""

    TYPE = MsgType.PONG
    seq: NonNeg
    sent_ns: NonNeg = 0
    free_blocks: Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)] = -1
    sequences: NonNeg = 0


class Generate(Message, frozen=True):
    """C → P: generate from `prompt` (text) or `prompt_tokens`; answers stream TOKENS then FINISH."""

    TYPE = MsgType.GENERATE
    sampling: SamplingParams
    prompt: str | None = None
    prompt_tokens: list[TokenId] | None = None
    request_id: RequestId | None = None
    stream: bool = True


class Status(Message, frozen=True):
    """C → P or C → D (as the first frame of a connection): answered by StatusReply."""

    TYPE = MsgType.STATUS


class ModelCard(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The daemon's model as its clients need it (STATUS_REPLY's `model_card`): `name`, what the
    HTTP API serves it as (the checkpoint directory's name, or `pdkv-tiny`); `path`, the
    checkpoint directory, absolute (`""`: the built-in tiny model); `max_positions`, its context
    length (max_position_embeddings): a prompt and the tokens asked for must fit in it."""

    name: str
    path: str = ""
    max_positions: NonNeg = 0


class StatusReply(Message, frozen=True):
    TYPE = MsgType.STATUS_REPLY
    role: str
    pid: NonNeg
    uptime_s: float
    pool: dict[str, int]
    inflight: NonNeg
    links: list[dict[str, str | int | float]] = []
    device: str = "cpu"
    backend: str = "shm"
    model: str = ""  # the model's fingerprint name (tiny-seed0-… or the checkpoint dir's name)
    dtype: str = ""
    served: NonNeg = 0  # requests finished since start
    tokens_per_s: float = 0.0  # generated tokens per second over the last minute
    model_card: ModelCard | None = None
    # the prefill's prefix cache (v8): enabled, queried_tokens, hit_tokens, evictions,
    # cached_blocks, named_blocks; {} from a daemon without one
    prefix_cache: dict[str, int] = {}
    # the daemon's --instance name (ROLE@HOSTNAME:RUNTIME_DIR by default); "" from an older one
    instance: Annotated[str, msgspec.Meta(max_length=256)] = ""


ALL_MESSAGES: tuple[type[Message], ...] = (
    Hello,
    HelloOk,
    Register,
    Registered,
    Handoff,
    KvReady,
    KvLaunched,
    Release,
    Tokens,
    Finish,
    StepTokens,
    Abort,
    Error,
    Ping,
    Pong,
    Push,
    PushFailed,
    Generate,
    Status,
    StatusReply,
)
BY_TYPE: dict[int, type[Message]] = {cls.TYPE: cls for cls in ALL_MESSAGES}
