"""The client frames of one prefill request: TOKENS (with streamed text) and FINISH.

Text is decoded incrementally (`text_delta`, a common.model.detokenizer stream per request), so
the tokenizer runs over the new tokens only, and held back while it ends inside a UTF-8 sequence;
FINISH carries the prefill's timings (`TIMINGS`, spans between the request's marks) on top of the
decode's and is where the request's one `request_finished` log line is written.
"""

from __future__ import annotations

from typing import Any

import structlog

from common.model.detokenizer import text_stream
from common.protocol import MAX_LOGPROBS_PER_FRAME, Finish, Tokens, Usage
from common.sampling_params import TokenLogprob
from common.timings import Span
from prefill_server.request import PrefillRequest

log = structlog.get_logger(__name__)
_MS = 1_000_000

TIMINGS = (  # `always`: a stage the request skipped (no handoff, no RELEASE before FINISH) reads 0.0
    Span("ttft_ms", "arrived", "first_token", _MS, always=True),
    # of it: arrival -> its blocks and event slot held, queued for a forward -> that forward
    # (its first chunk's) starts -> its (last) forward back on the loop
    Span("prefill_admit_us", "arrived", "queued"),
    Span("prefill_queue_us", "queued", "forward_started"),
    Span("prefill_forward_us", "forward_started", "forward_done"),
    # before it: the GENERATE read from the client's socket -> the request admitted (its task
    # started, the prompt checked); after it: the first token -> its TOKENS queued to the client
    # (after an early HANDOFF, KV_READY sent first)
    Span("prefill_read_us", "read", "arrived"),
    Span("first_out_us", "first_token", "first_out"),
    # the KV ready to move -> RELEASE received
    Span("handoff_us", "kv_offered", "released", always=True),
    # the first token on the loop -> the (last) HANDOFF sent: negative for an early handoff
    Span("handoff_after_first_us", "first_token", "handoff_sent", always=True),
    # v12, after a KV_LAUNCHED: its first token queued on the GPU (the torch thread) -> the
    # frame sent (the loop); and that frame -> KV_READY sent (how much sooner the decode knew)
    Span("launch_send_us", "launch_queued", "kv_launched"),
    Span("launch_ahead_us", "kv_launched", "kv_offered"),
    Span("total_ms", "arrived", "finished", _MS, always=True),
)
"""The timings the prefill adds to the decode's in FINISH (docs/protocol.md, "FINISH")."""


class RequestOutput:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def tokens(
        self, req: PrefillRequest, new: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> Tokens:
        """TOKENS for the client: with the new text when it streams, else ids only (the whole
        text comes once, in FINISH, so the tokenizer runs once per request); with the tokens'
        logprobs when the request asked for them."""
        text = self.text_delta(req, final=False) if req.stream else ""
        return Tokens(request_id=req.request_id, tokens=new, text=text, logprobs=logprobs)

    def prompt_logprobs(
        self, req: PrefillRequest, entries: list[TokenLogprob] | None
    ) -> list[Tokens]:
        """The prompt's logprobs as TOKENS frames without tokens, MAX_LOGPROBS_PER_FRAME each."""
        if not entries:
            return []
        step = MAX_LOGPROBS_PER_FRAME
        return [
            Tokens(request_id=req.request_id, tokens=[], prompt_logprobs=entries[i : i + step])
            for i in range(0, len(entries), step)
        ]

    def text_delta(self, req: PrefillRequest, *, final: bool) -> str:
        """Text of the tokens not yet turned into text, from the request's incremental
        detokenizer (common.model.detokenizer: O(new tokens) a call, held back while it ends
        inside a character). A request that never streamed is decoded once, whole, at the end."""
        if final and req.text is None:
            req.text_tokens = len(req.generated)
            return self.tokenizer.decode(req.generated)
        if req.text is None:
            req.text = text_stream(self.tokenizer)
        new = req.generated[req.text_tokens :]
        req.text_tokens = len(req.generated)
        text = req.text.add(new) if new else ""
        return text + req.text.flush() if final else text

    def finish(self, req: PrefillRequest, reason: str, decode_timings: dict[str, float]) -> Finish:
        """FINISH for the client, and the request's `request_finished` log line."""
        timings = {**decode_timings, **req.marks.render(TIMINGS)}
        log.info(
            "request_finished",
            request_id=req.request_id,
            reason=reason,
            link=req.link_id or None,  # link-N@DECODE: the decode it was handed to
            prompt_tokens=len(req.prompt_tokens),
            completion_tokens=len(req.generated),
            cached_tokens=req.cached_tokens,
            direct_frames=req.direct_frames,  # the decode's TOKENS relayed without its task
            **timings,
        )
        return Finish(
            request_id=req.request_id,
            reason=reason,
            usage=Usage(
                prompt_tokens=len(req.prompt_tokens),
                completion_tokens=len(req.generated),
                cached_tokens=req.cached_tokens,
            ),
            timings=timings,
            text=self.text_delta(req, final=True),
            decode=req.link_id,
        )
