"""OpenAI's response shapes for /v1/completions and /v1/chat/completions, whole or streamed.

A request has one choice per prompt, each with its `index`; `usage` sums its prompts. Streamed,
the choices' chunks interleave as their text comes, each chunk carrying one choice.

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

Events = AsyncIterator[tuple[int, str | Done]]


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What differs between the two endpoints' bodies."""

    endpoint: str
    chat: bool

    def delta(self, index: int, text: str) -> dict[str, Any]:
        if self.chat:
            return {
                "index": index,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": None,
            }
        return {"index": index, "text": text, "logprobs": None, "finish_reason": None}

    def final_delta(self, index: int, reason: str) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}

    def whole(self, index: int, text: str, reason: str) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {"index": index, "message": message, "logprobs": None, "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


@dataclass(frozen=True, kw_only=True)
class Reply:
    """One request's identity in its response bodies, and its number of choices."""

    id: str
    model: str
    shape: Shape
    started: float
    created: int
    choices: int = 1
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


def usage(dones: list[Done]) -> dict[str, Any]:
    """OpenAI's usage of a request: its prompts' counts summed; `prompt_tokens_details`'s
    `cached_tokens` are the prompt tokens the prefill's prefix cache supplied (0 for a prompt the
    API ended at a stop string before its FINISH)."""
    prompt = sum(d.prompt_tokens for d in dones)
    completion = sum(d.completion_tokens for d in dones)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in dones)},
    }


async def whole(reply: Reply, events: Events, metrics: Metrics) -> Response:
    """The non-streamed response: each choice's text and finish_reason, and usage, in one body."""
    parts: list[list[str]] = [[] for _ in range(reply.choices)]
    dones: dict[int, Done] = {}
    async with contextlib.aclosing(events):
        async for index, item in events:
            if isinstance(item, Done):
                dones[index] = item
            else:
                parts[index].append(item)
    ended = [dones[i] for i in range(reply.choices)]
    _count_tokens(metrics, ended)
    metrics.finished(reply.shape.endpoint, "ok", time.perf_counter() - reply.started)
    choices = [
        reply.shape.whole(i, "".join(parts[i]), done.finish_reason) for i, done in enumerate(ended)
    ]
    return json_response(reply.body(reply.shape.object, choices, usage=usage(ended)))


async def streamed(reply: Reply, events: Events, metrics: Metrics) -> Response:
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
    reply: Reply, first: tuple[int, str | Done], events: Events, metrics: Metrics
) -> AsyncIterator[bytes]:
    shape, obj = reply.shape, reply.shape.chunk_object
    extra = {"usage": None} if reply.include_usage else {}
    outcome = "client_disconnect"
    dones: list[Done] = []
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
            index, item = first
            while True:
                if isinstance(item, Done):
                    dones.append(item)
                    choice = shape.final_delta(index, item.finish_reason)
                else:
                    choice = shape.delta(index, item)
                yield event(reply.body(obj, [choice], **extra))
                if len(dones) == reply.choices:
                    break
                index, item = await anext(events)
            if reply.include_usage:
                yield event(reply.body(obj, [], usage=usage(dones)))
            _count_tokens(metrics, dones)
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


def _count_tokens(metrics: Metrics, dones: list[Done]) -> None:
    metrics.tokens.labels("prompt").inc(sum(d.prompt_tokens for d in dones))
    metrics.tokens.labels("completion").inc(sum(d.completion_tokens for d in dones))
