"""OpenAI's response shapes for /v1/completions and /v1/chat/completions, whole or streamed.

A request has n choices per prompt (choice i*n + j is prompt i's j-th), each with its `index`;
`usage` counts each prompt once (as OpenAI does, whatever n) and every choice's completion. Streamed, the choices' chunks interleave as their text comes, each chunk
carrying one choice and the logprobs of its tokens when asked (api_server.logprobs); with `echo`
a choice's first chunk is its prompt.

A streamed response starts only after the request's first event, so a request the daemons refuse
at once (bad prompt, NO_CAPACITY, no link) still gets its proper status code. A failure after
that is sent as one `data: {"error": ...}` event before `data: [DONE]`. Every request's outcome
is counted once, where its response is decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response, StreamingResponse

from api_server.errors import ApiError
from api_server.generation import Done, Piece
from api_server.logprobs import ChoiceLogprobs, Echo, LogprobFormat
from api_server.metrics import Metrics
from api_server.sse import DONE, event, json_response
from api_server.tools.assembler import ToolAssembler, fold
from api_server.tools.content_logprobs import ContentLogprobs

Events = AsyncIterator[tuple[int, Piece | Done]]


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What differs between the two endpoints' bodies."""

    endpoint: str
    chat: bool

    def delta(self, index: int, text: str, logprobs: Any = None) -> dict[str, Any]:
        if self.chat:
            return {
                "index": index,
                "delta": {"content": text},
                "logprobs": logprobs,
                "finish_reason": None,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def final_delta(self, index: int, reason: str) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}

    def whole(self, index: int, text: str, reason: str, logprobs: Any = None) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

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
    n: int = 1  # choices per prompt: choice i * n + j is prompt i's j-th
    include_usage: bool = False
    fmt: LogprobFormat | None = None  # when the request asked for logprobs
    echoes: list[Echo] | None = None  # completions with echo: each choice's prompt
    # chat with tools read from the answer: a new assembler per choice (api_server.tools)
    tools: Callable[[], ToolAssembler | None] | None = None

    def assembler(self) -> ToolAssembler | None:
        return None if self.tools is None else self.tools()

    def content_logprobs(self) -> ContentLogprobs | None:
        """A tracker of which entries are content, for a chat choice read for tool calls
        (None when the request did not ask for logprobs)."""
        return None if self.fmt is None else ContentLogprobs(self.fmt.counter.decode)

    def echo(self, index: int) -> Echo | None:
        return None if self.echoes is None else self.echoes[index]

    def logprobs(
        self, index: int, lp: ChoiceLogprobs, *, with_echo: bool, offset: int = 0
    ) -> dict[str, Any] | None:
        """Choice `index`'s logprobs object for the entries in `lp` (None when not asked)."""
        if self.fmt is None:
            return None
        if self.shape.chat:
            return self.fmt.chat(lp.generated)
        echo = self.echo(index) if with_echo else None
        return self.fmt.completion(lp.generated, echo=echo, prompt=lp.prompt, offset=offset)

    def body(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def usage(dones: list[Done], n: int = 1) -> dict[str, Any]:
    """OpenAI's usage of a request whose `dones` are in choice order, `n` per prompt: each
    prompt's tokens counted once (its n choices each prefilled it, but OpenAI bills a prompt
    once), every choice's completion tokens. `prompt_tokens_details`'s `cached_tokens` are the
    prompt tokens the prefill's prefix cache supplied, the most any of the prompt's choices got
    (0 for a choice the API ended at a stop string before its FINISH)."""
    per_prompt = [dones[i : i + n] for i in range(0, len(dones), n)]
    prompt = sum(max(d.prompt_tokens for d in choices) for choices in per_prompt)
    cached = sum(max(d.cached_tokens for d in choices) for choices in per_prompt)
    completion = sum(d.completion_tokens for d in dones)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def whole(reply: Reply, events: Events, metrics: Metrics) -> Response:
    """The non-streamed response: each choice's text and finish_reason, and usage, in one body."""
    parts: list[list[str]] = [[] for _ in range(reply.choices)]
    lps = [ChoiceLogprobs() for _ in range(reply.choices)]
    dones: dict[int, Done] = {}
    async with contextlib.aclosing(events):
        async for index, item in events:
            if isinstance(item, Done):
                dones[index] = item
            else:
                parts[index].append(item.text)
                lps[index].generated.extend(item.logprobs)
                lps[index].prompt.extend(item.prompt)
    ended = [dones[i] for i in range(reply.choices)]
    _count_tokens(metrics, ended)
    metrics.finished(reply.shape.endpoint, "ok", time.perf_counter() - reply.started)
    choices = []
    for i, done in enumerate(ended):
        if (assembler := reply.assembler()) is not None:
            choices.append(_with_tools(reply, i, assembler, parts[i], lps[i], done))
            continue
        echo = reply.echo(i)
        text = (echo.text if echo else "") + "".join(parts[i])
        logprobs = reply.logprobs(i, lps[i], with_echo=True)
        choices.append(reply.shape.whole(i, text, done.finish_reason, logprobs))
    return json_response(reply.body(reply.shape.object, choices, usage=usage(ended, reply.n)))


def _with_tools(
    reply: Reply,
    index: int,
    assembler: ToolAssembler,
    parts: list[str],
    lp: ChoiceLogprobs,
    done: Done,
) -> dict[str, Any]:
    """A whole chat choice whose text is read for tool calls: the fold of its streamed deltas,
    and the logprobs of its content's tokens when asked (api_server.tools.content_logprobs)."""
    deltas = [d for text in parts for d in assembler.feed(text)]
    last, reason = assembler.finish(done.finish_reason)
    message = fold(deltas + last)
    logprobs = None
    if (content := reply.content_logprobs()) is not None:
        assert reply.fmt is not None
        content.add(lp.generated)
        entries = content.upto(assembler.content_chars) if assembler.called else content.rest()
        logprobs = reply.fmt.chat(entries)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


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
    reply: Reply, first: tuple[int, Piece | Done], events: Events, metrics: Metrics
) -> AsyncIterator[bytes]:
    shape, obj = reply.shape, reply.shape.chunk_object
    extra = {"usage": None} if reply.include_usage else {}
    outcome = "client_disconnect"
    dones: dict[int, Done] = {}
    choices = [
        _StreamedChoice(assembler=reply.assembler(), content=reply.content_logprobs())
        for _ in range(reply.choices)
    ]
    try:
        async with contextlib.aclosing(events):
            if shape.chat:
                for i in range(reply.choices):
                    role = {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield event(reply.body(obj, [role], **extra))
            index, item = first
            while True:
                for choice in _chunks(reply, index, item, choices[index]):
                    yield event(reply.body(obj, [choice], **extra))
                if isinstance(item, Done):
                    dones[index] = item
                    if len(dones) == reply.choices:
                        break
                index, item = await anext(events)
            ended = [dones[i] for i in range(reply.choices)]
            if reply.include_usage:
                yield event(reply.body(obj, [], usage=usage(ended, reply.n)))
            _count_tokens(metrics, ended)
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


@dataclass
class _StreamedChoice:
    prompt: ChoiceLogprobs = field(default_factory=ChoiceLogprobs)  # held until its echo
    echoed: bool = False
    offset: int = 0  # characters of its text sent so far (text_offset)
    assembler: ToolAssembler | None = None  # chat with tools: its text read for calls
    content: ContentLogprobs | None = None  # with tools and logprobs: its content's entries


def _chunks(
    reply: Reply, index: int, item: Piece | Done, state: _StreamedChoice
) -> list[dict[str, Any]]:
    """The chunks of one event of choice `index`: its echo first (once, when its prompt
    logprobs are all in: at its first token or its end), then its text and logprobs."""
    if state.assembler is not None:
        return _tool_chunks(reply, index, item, state.assembler, state.content)
    if isinstance(item, Piece) and item.prompt:
        state.prompt.prompt.extend(item.prompt)
        if not item.text and not item.logprobs:
            return []
    out = []
    echo = reply.echo(index)
    if echo is not None and not state.echoed:
        state.echoed = True
        logprobs = reply.logprobs(index, state.prompt, with_echo=True)
        out.append(reply.shape.delta(index, echo.text, logprobs))
        state.offset = len(echo.text)
    if isinstance(item, Done):
        out.append(reply.shape.final_delta(index, item.finish_reason))
        return out
    piece = ChoiceLogprobs(generated=item.logprobs)
    logprobs = reply.logprobs(index, piece, with_echo=False, offset=state.offset)
    state.offset += len(item.text)
    out.append(reply.shape.delta(index, item.text, logprobs))
    return out


def _tool_chunks(
    reply: Reply,
    index: int,
    item: Piece | Done,
    assembler: ToolAssembler,
    content: ContentLogprobs | None,
) -> list[dict[str, Any]]:
    """The chunks of one event of a chat choice whose text is read for tool calls. With
    logprobs, a content delta carries the entries of the tokens its text begins in; at the end
    of a choice that made no call, the entries left (tokens without text: its EOS) ride on the
    finish chunk; the calls' tokens are never sent."""
    if isinstance(item, Piece):
        if content is not None:
            content.add(item.logprobs)
        deltas, reason = assembler.feed(item.text), None
    else:
        deltas, reason = assembler.finish(item.finish_reason)
    chars = assembler.content_chars - sum(len(d.get("content", "")) for d in deltas)
    out = []
    for d in deltas:
        logprobs = None
        if content is not None and "content" in d:
            assert reply.fmt is not None
            chars += len(d["content"])
            logprobs = reply.fmt.chat(content.upto(chars))
        out.append({"index": index, "delta": d, "logprobs": logprobs, "finish_reason": None})
    if reason is not None:
        logprobs = None
        if content is not None and not assembler.called and (rest := content.rest()):
            assert reply.fmt is not None
            logprobs = reply.fmt.chat(rest)
        out.append({"index": index, "delta": {}, "logprobs": logprobs, "finish_reason": reason})
    return out


def _count_tokens(metrics: Metrics, dones: list[Done]) -> None:
    metrics.tokens.labels("prompt").inc(sum(d.prompt_tokens for d in dones))
    metrics.tokens.labels("completion").inc(sum(d.completion_tokens for d in dones))
