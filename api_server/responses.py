"""OpenAI's response shapes for /v1/completions and /v1/chat/completions, whole or streamed.

A streamed response starts only after the request's first event, so a request the daemons refuse
at once (bad prompt, NO_CAPACITY, no link) still gets its proper status code. A failure after
that is sent as one `data: {"error": ...}` event before `data: [DONE]`. Every request's outcome
is counted once, where its response is decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response, StreamingResponse

from api_server.errors import ApiError
from api_server.generation import Done
from api_server.metrics import Metrics
from api_server.sse import DONE, event, json_response


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What differs between the two endpoints' bodies."""

    endpoint: str
    chat: bool

    def delta(self, text: str) -> dict[str, Any]:
        if self.chat:
            return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}

    def final_delta(self, reason: str) -> dict[str, Any]:
        if self.chat:
            return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}

    def whole(self, text: str, reason: str) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


@dataclass(frozen=True, kw_only=True)
class Reply:
    """One request's identity in its response bodies."""

    id: str
    model: str
    shape: Shape
    started: float
    created: int
    include_usage: bool = False

    def body(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def usage(done: Done) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


async def whole(reply: Reply, events: AsyncIterator[str | Done], metrics: Metrics) -> Response:
    """The non-streamed response: all the text, finish_reason and usage in one body."""
    parts: list[str] = []
    async with contextlib.aclosing(events):
        async for item in events:
            if isinstance(item, Done):
                done = item
            else:
                parts.append(item)
    _count_tokens(metrics, done)
    metrics.finished(reply.shape.endpoint, "ok", time.perf_counter() - reply.started)
    choice = reply.shape.whole("".join(parts), done.finish_reason)
    return json_response(reply.body(reply.shape.object, [choice], usage=usage(done)))


async def streamed(reply: Reply, events: AsyncIterator[str | Done], metrics: Metrics) -> Response:
    """The streamed response; raises ApiError when the request fails before its first event."""
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(
        _sse(reply, first, events, metrics),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _sse(
    reply: Reply, item: str | Done, events: AsyncIterator[str | Done], metrics: Metrics
) -> AsyncIterator[bytes]:
    shape, obj = reply.shape, reply.shape.chunk_object
    extra = {"usage": None} if reply.include_usage else {}
    outcome = "client_disconnect"
    try:
        async with contextlib.aclosing(events):
            if shape.chat:
                role = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield event(reply.body(obj, [role], **extra))
            while not isinstance(item, Done):
                yield event(reply.body(obj, [shape.delta(item)], **extra))
                item = await anext(events)
            yield event(reply.body(obj, [shape.final_delta(item.finish_reason)], **extra))
            if reply.include_usage:
                yield event(reply.body(obj, [], usage=usage(item)))
            _count_tokens(metrics, item)
            outcome = "ok"
            yield DONE
    except ApiError as exc:
        outcome = exc.outcome
        yield event(exc.body())
        yield DONE
    except asyncio.CancelledError:
        outcome = "client_disconnect"
        raise
    finally:
        seconds = time.perf_counter() - reply.started if outcome == "ok" else None
        metrics.finished(shape.endpoint, outcome, seconds)


def _count_tokens(metrics: Metrics, done: Done) -> None:
    metrics.tokens.labels("prompt").inc(done.prompt_tokens)
    metrics.tokens.labels("completion").inc(done.completion_tokens)
