"""One choice's answer as OpenAI's chat deltas when tools may be called: text as `content`, calls
as `tool_calls` entries (index, id, type and name first, then fragments of the arguments).

The text streams as content until a parser's start marker may be beginning; from there it is
held and read as calls. A call is announced once its name is complete and its arguments follow
as they arrive (an object's text streams; another value is sent once complete). When the held
text turns out not to be calls (malformed before any call was announced, or a call without a
name at the end), it is sent as content after all. The non-streamed answer is these deltas
folded (`fold`), so the two cannot disagree.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from api_server.tools.parsers import PartialCall, ToolParser


def call_id() -> str:
    """A tool call's id, as OpenAI's: call_ and 24 random characters."""
    return "call_" + secrets.token_hex(12)


def short_call_id() -> str:
    """A tool call's id as Mistral's templates demand it back in the history: 9 letters and
    digits (they raise on any other)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


_ALNUM = string.ascii_letters + string.digits


@dataclass
class _Sent:
    id: str
    arguments: int = 0  # characters of the arguments sent


@dataclass
class ToolAssembler:
    """Turns one choice's text deltas into chat deltas. feed() for each piece of text, finish()
    once at its end. Not thread-safe; one per choice."""

    parser: ToolParser
    max_calls: int | None = None  # with parallel_tool_calls false: 1, later calls dropped
    new_id: Callable[[], str] = call_id
    _held: str = ""
    _region: str | None = None  # the text from where the calls begin, once they have
    _given_up: bool = False  # the calls region was text after all: all text is content
    _content_sent: bool = False
    _content_chars: int = 0
    _sent: list[_Sent] = field(default_factory=list)

    @property
    def called(self) -> bool:
        """True once a call has been announced."""
        return bool(self._sent)

    @property
    def content_chars(self) -> int:
        """Characters sent as content so far: always the first ones of the answer's text."""
        return self._content_chars

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas that `text`, the next piece of the answer, makes safe to send."""
        if self._given_up:
            return self._content(text)
        if self._region is not None:
            self._region += text
            return self._calls(final=False)
        buf = self._held + text
        at_start = not self._content_sent
        start = self.parser.start(buf, at_start)
        if start is None:
            keep = self.parser.held(buf, at_start)
            self._held = buf[len(buf) - keep :]
            return self._content(buf[: len(buf) - keep])
        self._held, self._region = "", buf[start:]
        return self._content(buf[:start]) + self._calls(final=False)

    def finish(self, reason: str) -> tuple[list[dict[str, Any]], str]:
        """(the last deltas, the finish reason): `tool_calls` when calls were made and the
        answer ended by itself (`reason` "stop"), else `reason`."""
        out = self._content(self._held)
        self._held = ""
        if self._region is not None and not self._given_up:
            out += self._calls(final=True)
        return out, "tool_calls" if self.called and reason == "stop" else reason

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self._content_sent = True
        self._content_chars += len(text)
        return [{"content": text}]

    def _calls(self, *, final: bool) -> list[dict[str, Any]]:
        assert self._region is not None
        calls = self.parser.calls(self._region)
        if final and calls is not None and not self.called and not _all_named(calls):
            calls = None
        if calls is None:
            if self.called:  # what was announced stands; the rest is dropped
                return []
            self._given_up = True
            return self._content(self._region)
        out = []
        for index, call in enumerate(calls[: self.max_calls]):
            if call.name is None:
                break  # later calls wait for this one's name
            if index == len(self._sent):
                self._sent.append(_Sent(self.new_id()))
                out.append(_header(index, self._sent[index].id, call.name))
            out += self._arguments(index, call, final)
        return out

    def _arguments(self, index: int, call: PartialCall, final: bool) -> list[dict[str, Any]]:
        sent = self._sent[index]
        if not call.streamable and not call.complete and not final:
            return []
        text = call.arguments if call.streamable else _object_text(call.arguments)
        if len(text) <= sent.arguments:
            return []
        fragment, sent.arguments = text[sent.arguments :], len(text)
        return [{"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}]


def _all_named(calls: list[PartialCall]) -> bool:
    return bool(calls) and all(c.name is not None for c in calls)


def _object_text(value: str) -> str:
    """The arguments a complete non-object value stands for: a JSON string that holds an object
    is that object's text (some models quote their arguments); anything else as written."""
    try:
        inner = json.loads(value)
    except ValueError:
        return value
    return inner if isinstance(inner, str) and inner.lstrip().startswith("{") else value


def _header(index: int, id: str, name: str) -> dict[str, Any]:
    call = {
        "index": index,
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }
    return {"tool_calls": [call]}


def fold(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message that `deltas` stream: its content (None when it is only calls) and
    its tool_calls (left out when none)."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict[str, Any]] = []
    for d in deltas:
        for part in d.get("tool_calls", ()):
            if "id" in part:
                fn = part["function"]
                calls.append({"id": part["id"], "type": "function", "function": dict(fn)})
            else:
                calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message
