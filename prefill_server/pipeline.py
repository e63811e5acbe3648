"""The life of one request in the prefill daemon, as an async generator of client frames.

admit (validate, wait for blocks) → prefill (torch thread) → first token to the client → lease the
blocks to the link and HANDOFF (retried while the decode answers NO_CAPACITY, until the handoff
deadline) → relay TOKENS/FINISH. Whatever ends the request, `finally` frees its blocks exactly once
and an unfinished handoff is aborted on the decode side.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import structlog

from common.errors import PdkvError
from common.model.sampling import finish_reason
from common.protocol import (
    Abort,
    Error,
    ErrorCode,
    Finish,
    Generate,
    Handoff,
    Message,
    Release,
    Tokens,
    Usage,
)
from prefill_server.forward import run_prefill
from prefill_server.request import PrefillRequest

if TYPE_CHECKING:
    from prefill_server.server import PrefillServer

log = structlog.get_logger(__name__)
_TEXT_CONTEXT = 4  # emitted tokens decoded again as context for the next text delta


class RequestFailed(PdkvError):
    """A request ends with an ERROR frame of `code` to its client."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class RequestPipeline:
    def __init__(self, server: PrefillServer) -> None:
        self.s = server
        self._freed = asyncio.Event()
        # event slots named in a HANDOFF the decode may still wait on: reusable after its RELEASE
        # or the end of the link, never before (re-recording early is the LMCache race)
        self._quarantine: set[int] = set()

    def capacity_changed(self) -> None:
        """Wake every request waiting for blocks."""
        self._freed.set()
        self._freed = asyncio.Event()

    def on_release(self, req: PrefillRequest, msg: Release) -> None:
        """RELEASE from the decode: the KV is copied; free the blocks (and, on CUDA, the slot)."""
        alloc = self.s.rt.allocator
        if req.released or req.request_id not in alloc:
            return
        alloc.release(req.request_id)
        req.released = True
        req.handoff_us = (time.monotonic_ns() - req.handoff_sent_ns) / 1000
        self._release_slot(req)
        self.capacity_changed()

    async def _acquire_slot(self, req: PrefillRequest, deadline: float) -> None:
        events = self.s.events
        if events is None:
            return
        while (slot := events.acquire()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestFailed(
                    ErrorCode.NO_CAPACITY, f"all {len(events)} handoff event slots busy"
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._freed.wait()
        req.event_slot = slot

    def _release_slot(self, req: PrefillRequest) -> None:
        if req.event_slot >= 0 and self.s.events is not None:
            self.s.events.release(req.event_slot)
        req.event_slot = -1

    def unquarantine(self, slot: int) -> None:
        """A late RELEASE acknowledged `slot`: it may be recorded again."""
        if slot in self._quarantine and self.s.events is not None:
            self._quarantine.discard(slot)
            self.s.events.release(slot)
            self.capacity_changed()

    def unquarantine_all(self) -> None:
        for slot in list(self._quarantine):
            self.unquarantine(slot)

    async def run(self, rid: str, msg: Generate) -> AsyncIterator[Tokens | Finish]:
        s = self.s
        if s.stopping:
            raise RequestFailed(ErrorCode.SHUTTING_DOWN, "prefill daemon is shutting down")
        if rid in s.requests:
            raise RequestFailed(ErrorCode.BAD_REQUEST, f"request id {rid} is already in flight")
        if len(s.requests) >= s.cfg.max_pending:
            raise RequestFailed(
                ErrorCode.NO_CAPACITY,
                f"{len(s.requests)} requests in flight, the limit is {s.cfg.max_pending} "
                "(retry later, or raise --max-pending)",
            )
        prompt = self._prompt(msg)
        sampling = msg.sampling.validate().with_seed()
        req = PrefillRequest(rid, prompt, sampling, stream=msg.stream)
        s.requests[rid] = req
        try:
            blocks = await self._allocate(req)
            await self._acquire_slot(req, time.monotonic() + s.cfg.handoff_timeout_s)
            first = await s.rt.run(
                run_prefill, s.rt, prompt, blocks, sampling, s.events, req.event_slot
            )
            req.generated.append(first)
            req.ttft_ms = (time.monotonic() - req.arrived) * 1000
            yield self._tokens(req, [first])
            reason = finish_reason(req.generated, sampling, s.rt.model.config.stop_token_ids)
            if reason:  # nothing left to decode: no handoff
                yield self._finish(req, reason, {})
                return
            first_answer = await self._handoff(req, blocks)
            async for out in self._relay(req, first_answer):
                yield out
        finally:
            self._cleanup(req)

    # ---- steps ---------------------------------------------------------------------------------
    def _prompt(self, msg: Generate) -> list[int]:
        rt = self.s.rt
        if (msg.prompt is None) == (msg.prompt_tokens is None):
            raise RequestFailed(
                ErrorCode.BAD_REQUEST, "give exactly one of prompt or prompt_tokens"
            )
        tokens = rt.tokenizer.encode(msg.prompt) if msg.prompt is not None else msg.prompt_tokens
        assert tokens is not None
        limit = self.s.cfg.max_prompt_tokens
        if not 0 < len(tokens) <= limit:
            raise RequestFailed(
                ErrorCode.BAD_REQUEST, f"prompt has {len(tokens)} tokens; allowed 1..{limit}"
            )
        vocab = rt.model.config.vocab_size
        if max(tokens) >= vocab:
            raise RequestFailed(ErrorCode.BAD_REQUEST, f"token id {max(tokens)} >= vocab {vocab}")
        return list(tokens)

    async def _allocate(self, req: PrefillRequest) -> list[int]:
        alloc, bs = self.s.rt.allocator, self.s.rt.layout.block_size
        need = -(-len(req.prompt_tokens) // bs)
        if need > alloc.total:
            raise RequestFailed(
                ErrorCode.BAD_REQUEST,
                f"prompt needs {need} blocks, the pool has {alloc.total} (raise --num-blocks)",
            )
        deadline = time.monotonic() + self.s.cfg.handoff_timeout_s
        while not alloc.can_allocate(need):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestFailed(
                    ErrorCode.NO_CAPACITY,
                    f"no {need} free KV blocks within {self.s.cfg.handoff_timeout_s}s "
                    f"({alloc.num_free} free of {alloc.total})",
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._freed.wait()
        return alloc.allocate(req.request_id, need)

    async def _handoff(self, req: PrefillRequest, blocks: list[int]) -> Message:
        """Send HANDOFF (again while the decode answers NO_CAPACITY); the decode's first other
        answer for this request, which the relay must take before anything queued after it."""
        s = self.s
        deadline = time.monotonic() + s.cfg.handoff_timeout_s
        backoff = 0.005
        while True:
            left = deadline - time.monotonic()
            try:
                async with asyncio.timeout(max(left, 0)):
                    await s.link.ready.wait()
            except TimeoutError:
                raise RequestFailed(
                    ErrorCode.LINK_LOST,
                    f"no link to the decode daemon within {s.cfg.handoff_timeout_s}s "
                    f"({s.link.last_error or 'never connected'})",
                ) from None
            if not req.handed_off:
                s.rt.allocator.lease(
                    req.request_id, s.link.link_id, time.monotonic() + s.cfg.lease_timeout_s
                )
                req.handed_off, req.link_id = True, s.link.link_id
            req.handoff_sent_ns = time.monotonic_ns()
            handoff = Handoff(
                request_id=req.request_id,
                block_ids=blocks,
                num_tokens=len(req.prompt_tokens),
                prompt_tokens=req.prompt_tokens,
                first_token=req.generated[0],
                sampling=req.sampling,
                event_slot=req.event_slot,
                sent_ns=req.handoff_sent_ns,
            )
            try:
                await s.link.send(handoff, spin=True)
            except ConnectionError as exc:
                # the frame did not get through whole, so the decode cannot act on it: the
                # blocks and the event slot are ours again (freed by _cleanup, not quarantined)
                req.handed_off = False
                raise RequestFailed(ErrorCode.LINK_LOST, str(exc)) from None
            first = await req.inbox.get()
            if isinstance(first, Error) and first.code == ErrorCode.NO_CAPACITY:
                if time.monotonic() + backoff > deadline:
                    raise RequestFailed(
                        ErrorCode.NO_CAPACITY, f"decode has no capacity: {first.message}"
                    )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 0.2)
                if req.request_id not in s.rt.allocator:
                    # the link was lost or the lease expired meanwhile: the blocks are freed and
                    # the inbox holds the reason; never hand off blocks we no longer own
                    return await req.inbox.get()
                continue
            return first

    async def _relay(self, req: PrefillRequest, first: Message) -> AsyncIterator[Tokens | Finish]:
        msg = first
        while True:
            if isinstance(msg, Tokens):
                req.generated.extend(msg.tokens)
                yield self._tokens(req, msg.tokens)
            elif isinstance(msg, Finish):
                req.done = True
                yield self._finish(req, msg.reason, msg.timings)
                return
            elif isinstance(msg, Error):
                req.done = True
                raise RequestFailed(msg.code, msg.message)
            msg = await req.inbox.get()

    # ---- output --------------------------------------------------------------------------------
    def _tokens(self, req: PrefillRequest, new: list[int]) -> Tokens:
        """TOKENS for the client: with the new text when it streams, else ids only (the whole
        text comes once, in FINISH, so the tokenizer runs once per request)."""
        text = self._text_delta(req, final=False) if req.stream else ""
        return Tokens(request_id=req.request_id, tokens=new, text=text)

    def _text_delta(self, req: PrefillRequest, *, final: bool) -> str:
        """Text of the tokens not yet turned into text, decoded with a few already-emitted tokens
        as context (tokenizers that merge or space tokens need it): O(new tokens), not a decode of
        the whole generation per token. Held back while it ends in a partial UTF-8 sequence."""
        tok = self.s.rt.tokenizer
        start = max(0, req.text_tokens - _TEXT_CONTEXT)
        prefix = tok.decode(req.generated[start : req.text_tokens])
        text = tok.decode(req.generated[start:])
        if not final and (text.endswith("\ufffd") or not text.startswith(prefix)):
            return ""
        req.text_tokens = len(req.generated)
        return text[len(prefix) :] if text.startswith(prefix) else text

    def _finish(self, req: PrefillRequest, reason: str, decode_timings: dict[str, float]) -> Finish:
        total_ms = (time.monotonic() - req.arrived) * 1000
        timings = {
            **decode_timings,
            "ttft_ms": round(req.ttft_ms, 3),
            "handoff_us": round(req.handoff_us, 1),
            "total_ms": round(total_ms, 3),
        }
        log.info(
            "request_finished",
            request_id=req.request_id,
            reason=reason,
            prompt_tokens=len(req.prompt_tokens),
            completion_tokens=len(req.generated),
            **timings,
        )
        self.s.served += 1
        return Finish(
            request_id=req.request_id,
            reason=reason,
            usage=Usage(prompt_tokens=len(req.prompt_tokens), completion_tokens=len(req.generated)),
            timings=timings,
            text=self._text_delta(req, final=True),
        )

    def _cleanup(self, req: PrefillRequest) -> None:
        s = self.s
        rid = req.request_id
        if rid in s.rt.allocator:
            s.rt.allocator.free(rid)
        if (
            req.handed_off
            and not req.done
            and s.link.ready.is_set()
            and s.link.link_id == req.link_id
        ):
            # the client went away (or the prefill failed) while the decode still works on it
            task = asyncio.get_running_loop().create_task(_abort(s, rid))
            task.add_done_callback(lambda t: t.exception())
        if req.event_slot >= 0:
            if req.handed_off and not req.done:
                self._quarantine.add(req.event_slot)  # the decode may still wait on it
            else:
                self._release_slot(req)
            req.event_slot = -1
        if s.requests.get(rid) is req:
            del s.requests[rid]
        self.capacity_changed()


async def _abort(server: PrefillServer, rid: str) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        await server.link.send(Abort(request_id=rid))
