"""The decode's frames to the client, by one of two paths, entered from one place each.

- `stream`: the request's task relays its inbox (TOKENS, then FINISH or ERROR) in order.
- `direct` (the fast path): while that task waits on an empty inbox and the client keeps up,
  the link's read callback sends a TOKENS frame to the client itself, skipping the task's wake-up
  (on the H200's host, the per-token relay was 40 % of the prefill's samples under load).
  RequestPipeline.deliver tries it for every TOKENS before the inbox; FINISH and ERROR always go
  through the inbox, so the task still ends the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import structlog

from common.daemon.throughput import Throughput
from common.protocol import Error, ErrorCode, Finish, Message, Tokens
from prefill_server.output import RequestOutput
from prefill_server.request import PrefillRequest, RequestFailed

log = structlog.get_logger(__name__)


class Relay:
    def __init__(self, output: RequestOutput, throughput: Throughput) -> None:
        self.output = output
        self.throughput = throughput
        # TOKENS frames relayed from the read callback (direct) and by the request's task
        self.counts = {"direct": 0, "queued": 0}

    def direct(self, req: PrefillRequest, msg: Tokens) -> bool:
        """Relay the decode's TOKENS `msg` to the client now, from the read callback, as `stream`
        would (its tokens appended to `req.generated`, the same frame: text delta, logprobs),
        and return True; or return False, changing nothing, and the frame goes to the inbox.

        Direct only when no frame can overtake or be overtaken and no wait is skipped: the
        request's task waits in `stream` for its inbox (every frame before this one queued to
        the client, the handover done) and is not being cancelled, nothing is queued in the
        inbox, `msg` carries no prompt logprobs, and the client's writer takes a frame without
        waiting (`can_send_now`: open, within its high-water mark, not stalled past its write
        timeout). FINISH and ERROR always take the inbox, so the task still ends the request
        (usage, timings, cleanup) and its FINISH follows every TOKENS; once a frame is queued
        there every later one follows it until the task has taken them all. A failure here
        fails this request alone (ERROR INTERNAL through its inbox), never the link."""
        task, sink = req.waiting, req.sink
        if (
            task is None
            or sink is None
            or task.cancelling()
            or not req.inbox.empty()
            or msg.prompt_logprobs is not None
            or not sink.can_send_now()
        ):
            return False
        try:
            req.generated.extend(msg.tokens)
            sink.send_nowait(self.output.tokens(req, msg.tokens, msg.logprobs))
        except Exception as exc:  # a bug must not end the link's other requests
            log.exception("direct_relay_failed", request_id=req.request_id)
            error = f"{type(exc).__name__}: {exc}"
            req.inbox.put_nowait(Error(code=ErrorCode.INTERNAL, message=error))
            return True
        req.direct_frames += 1
        self.counts["direct"] += 1
        return True

    async def stream(self, req: PrefillRequest, first: Message) -> AsyncIterator[Tokens | Finish]:
        """The request's task: `first` and then its inbox's frames to the client, in order, its
        FINISH last (RequestFailed for an ERROR); TOKENS queued meanwhile go as one frame."""
        msg: Message = first
        while True:
            if isinstance(msg, Tokens):
                msg, after = req.more_tokens(msg)  # the steps queued meanwhile, in one frame
                req.generated.extend(msg.tokens)
                yield self.output.tokens(req, msg.tokens, msg.logprobs)
                if after is not None:
                    msg = after
                    continue
            elif isinstance(msg, Finish):
                yield self.finish(req, msg.reason, msg.timings)
                return
            elif isinstance(msg, Error):
                raise RequestFailed(msg.code, msg.message)
            req.waiting = asyncio.current_task()  # meanwhile TOKENS may go to the client direct
            try:
                msg = await req.inbox.get()
            finally:
                req.waiting = None

    def finish(self, req: PrefillRequest, reason: str, decode_timings: dict[str, float]) -> Finish:
        """The request's FINISH to its client, counted (status: served, tokens/s)."""
        req.marks.stamp("finished")
        self.throughput.add(len(req.generated), requests=1)
        return self.output.finish(req, reason, decode_timings)
