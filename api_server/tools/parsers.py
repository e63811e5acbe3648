"""Tool-call parsers: where a model's calls begin in its text, and what the calls are so far.

One parser per model family's format (vLLM's names), plus the two that read the JSON a grammar
forced (`tool_choice` required or a named function):

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call;
- `llama3_json` (Llama 3.1+): `{"name": ..., "parameters": {...}}` as the whole message (calls
  separated by `;`), or after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11), or
  `[TOOL_CALLS]name[ARGS]{...}` per call (v11 on; MistralV11 where the tokenizer or template has
  `[ARGS]`). These markers, like `<|python_tag|>`, are special tokens, which the daemons drop
  from the text: the API puts them back (api_server.tools.marker_text). A message that starts
  with a JSON array is read as pre-v11 calls too (a tokenizer that has no `[TOOL_CALLS]`).

A parser sees the text from the start of its calls (the `region`) and returns the calls it holds
so far, each with its arguments as far as they have come, or None when the region cannot hold
calls (then it is the message's text). Arguments are the model's own text of the value: a prefix
of it while it streams, the whole of it once complete; the API checks the whole parses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from api_server.tools.jsonscan import (
    Malformed,
    Memo,
    ObjectScan,
    scan_object,
    skip_ws,
    value_end,
)

#: The keys that hold a call's arguments, by format.
_ARG_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class PartialCall:
    """One call as far as it has come: its name once complete, its arguments' text so far."""

    name: str | None
    arguments: str = ""
    complete: bool = False  # the arguments' value has ended

    @property
    def streamable(self) -> bool:
        """True when every prefix of the arguments is a prefix of the final arguments (an object
        is; a string or scalar is sent once complete)."""
        return self.arguments.startswith("{")


def call_of(text: str, scan: ObjectScan, arg_keys: tuple[str, ...] = _ARG_KEYS) -> PartialCall:
    """The call an object `{"name": ..., "<arg key>": ...}` scanned so far describes; Malformed
    when its first key is neither the name nor the arguments (JSON that is not a call: known
    at once, so an answer that is only JSON is not held to its end)."""
    first = next(iter(scan.fields), None)
    if first is not None and first != "name" and first not in arg_keys:
        raise Malformed(f"a call's first key is name or {' or '.join(arg_keys)}, not {first!r}")
    name = scan.string(text, "name")
    for key in arg_keys:
        if key in scan.fields:
            start, end = scan.fields[key]
            return PartialCall(
                name, text[start : len(text) if end is None else end], end is not None
            )
    if scan.end is not None:  # a complete call without arguments: none
        return PartialCall(name, "{}", True)
    return PartialCall(name)


class ToolParser:
    """A format of tool calls in a model's text. `markers` begin the calls; `json_start`: a
    message whose text starts with this character (after whitespace) is calls too.

    One parser reads one answer: calls() is given a region that only grows (its scans resume
    where the last one stopped)."""

    name = ""
    markers: tuple[str, ...] = ()
    #: the format's markers that a tokenizer may hold as special tokens (dropped from the
    #: daemons' text: api_server.tools.marker_text puts them back)
    specials: tuple[str, ...] = ()
    json_start: str | None = None

    def __init__(self) -> None:
        self.memo: Memo = {}

    def start(self, text: str, at_message_start: bool) -> int | None:
        """Where the calls begin in `text` (None: not in it). `at_message_start`: no content
        has been sent before `text`."""
        if at_message_start and self.json_start is not None:
            i = skip_ws(text, 0)
            if i < len(text) and text[i] == self.json_start:
                return 0  # the leading whitespace is not content either
        hits = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(hits) if hits else None

    def held(self, text: str, at_message_start: bool) -> int:
        """How many characters at the end of `text` to hold back: they may begin the calls."""
        if at_message_start and self.json_start is not None and not text.strip():
            return len(text)  # leading whitespace: the message may still open with JSON
        keep = 0
        for m in self.markers:
            for k in range(min(len(m) - 1, len(text)), keep, -1):
                if text.endswith(m[:k]):
                    keep = k
                    break
        return keep

    def calls(self, region: str) -> list[PartialCall] | None:
        """The calls of `region` (text from where the calls begin) so far; None when it cannot
        hold calls."""
        raise NotImplementedError


class Hermes(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _close = "</tool_call>"

    def calls(self, region: str) -> list[PartialCall] | None:
        out: list[PartialCall] = []
        i = 0
        try:
            while True:
                i = skip_ws(region, i)
                if not region.startswith(self.markers[0], i):
                    return out  # the end, or text after the calls (dropped)
                i = skip_ws(region, i + len(self.markers[0]))
                if i == len(region):
                    return out
                scan = scan_object(region, i, self.memo)
                out.append(call_of(region, scan))
                if scan.end is None:
                    return out
                i = skip_ws(region, scan.end)
                if not region.startswith(self._close, i):
                    return out
                i += len(self._close)
        except Malformed:
            return out or None


class Llama3Json(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)
    specials = markers
    json_start = "{"

    def calls(self, region: str) -> list[PartialCall] | None:
        i = _after_marker(region, self.markers[0])
        if i is None:
            return []
        out: list[PartialCall] = []
        try:
            while True:
                i = skip_ws(region, i)
                if i == len(region):
                    return out
                scan = scan_object(region, i, self.memo)
                out.append(call_of(region, scan))
                if scan.end is None:
                    return out
                i = skip_ws(region, scan.end)
                if not region.startswith(";", i):
                    return out
                i += 1
        except Malformed:
            return out or None


def _after_marker(region: str, marker: str) -> int | None:
    """Where the JSON begins in `region`: after its leading whitespace and `marker` if it opens
    with it; None while the region is only the start of the marker."""
    i = skip_ws(region, 0)
    if marker.startswith(region[i:]):
        return None
    return i + len(marker) if region.startswith(marker, i) else i


def array_calls(
    region: str, i: int, arg_keys: tuple[str, ...] = _ARG_KEYS, memo: Memo | None = None
) -> list[PartialCall] | None:
    """The calls of a JSON array of call objects that starts at `region[i]`."""
    i = skip_ws(region, i)
    if i == len(region):
        return []
    if region[i] != "[":
        return None
    out: list[PartialCall] = []
    try:
        i = skip_ws(region, i + 1)
        while i < len(region) and region[i] != "]":
            scan = scan_object(region, i, memo)
            out.append(call_of(region, scan, arg_keys))
            if scan.end is None:
                return out
            i = skip_ws(region, scan.end)
            if region.startswith(",", i):
                i = skip_ws(region, i + 1)
    except Malformed:
        return out or None
    return out


class Mistral(ToolParser):
    """Mistral's calls, both forms, each after `[TOOL_CALLS]`: a JSON array of `{"name",
    "arguments"}` (tokenizers before v11), or the name, `[ARGS]` and the arguments' object
    (v11 on: `[TOOL_CALLS]name[ARGS]{...}` per call; `[CALL_ID]id` before `[ARGS]` is read and
    dropped). A message that opens with a JSON array is calls too (where `[TOOL_CALLS]` was
    dropped from the text); MistralV11 is the parser for checkpoints that never write that form."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    specials = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    json_start: str | None = "["

    def calls(self, region: str) -> list[PartialCall] | None:
        marker = self.markers[0]
        out: list[PartialCall] = []
        i = 0
        try:
            while True:
                i = skip_ws(region, i)
                if marker.startswith(region[i:]):
                    return out  # the end, or a marker still arriving
                if region.startswith(marker, i):
                    i = skip_ws(region, i + len(marker))
                elif out:
                    return out  # text after the calls (dropped)
                if i == len(region):
                    return out
                if region[i] == "[":  # the older form: a JSON array of calls
                    listed = array_calls(region, i, memo=self.memo)
                    return out or None if listed is None else out + listed
                call, i = _named_call(region, i, self.memo)
                out.append(call)
                if i is None:
                    return out
        except Malformed:
            return out or None


class MistralV11(Mistral):
    """Mistral's parser for a tokenizer of v11 on (`[ARGS]` in its vocabulary or template):
    its calls are `[TOOL_CALLS]name[ARGS]{...}`, and a message that opens with `[` is text."""

    json_start = None


_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"
#: what a function name may hold (OpenAI's rule; a dot too, as some templates write)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def _named_call(region: str, i: int, memo: Memo) -> tuple[PartialCall, int | None]:
    """The call `name[ARGS]{...}` (or `name[CALL_ID]id[ARGS]{...}`) at `region[i]` as far as it
    has come, and the index after it (None while it is incomplete); Malformed when the text
    cannot be one."""
    j = i
    while j < len(region) and region[j] in _NAME_CHARS:
        j += 1
    if j == len(region):
        return PartialCall(None), None  # the name may go on
    if j == i:
        raise Malformed(f"a call's name cannot start with {region[i]!r}")
    name = region[i:j]
    if region.startswith(_CALL_ID, j):
        k = j + len(_CALL_ID)
        while k < len(region) and region[k].isalnum():
            k += 1
        j = k
    rest = region[j : j + len(_ARGS)]
    if not region.startswith(_ARGS, j):
        if _ARGS.startswith(rest) or _CALL_ID.startswith(region[j : j + len(_CALL_ID)]):
            return PartialCall(None), None  # a marker still arriving
        raise Malformed(f"expected [ARGS] after the name {name!r}")
    k = skip_ws(region, j + len(_ARGS))
    if k == len(region):
        return PartialCall(name), None
    end = value_end(region, k, memo)
    return PartialCall(name, region[k : end or len(region)], end is not None), end


class Forced(ToolParser):
    """The whole text is calls: JSON a grammar forced. `function` set: the text is that
    function's arguments object (a named tool_choice); else an array of {"name", "parameters"}
    (tool_choice required)."""

    name = "forced"

    def __init__(self, function: str | None = None) -> None:
        super().__init__()
        self.function = function

    def start(self, text: str, at_message_start: bool) -> int | None:
        return 0

    def held(self, text: str, at_message_start: bool) -> int:
        return 0

    def calls(self, region: str) -> list[PartialCall] | None:
        if self.function is None:
            return array_calls(region, 0, ("parameters",), self.memo)
        i = skip_ws(region, 0)
        if i == len(region):
            return [PartialCall(self.function)]
        try:
            end = value_end(region, i, self.memo)
        except Malformed:
            return None
        return [PartialCall(self.function, region[i : end or len(region)], end is not None)]


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Hermes, Llama3Json, Mistral)}


def parser_for(
    family: str, vocabulary_has: Callable[[str], bool], template_source: str
) -> type[ToolParser]:
    """The parser of `family` for a checkpoint: for mistral, MistralV11 when its tokenizer
    (`vocabulary_has`) or its template knows `[ARGS]` (tokenizers v11 on), else Mistral."""
    if family == Mistral.name and (vocabulary_has(_ARGS) or _ARGS in template_source):
        return MistralV11
    return PARSERS[family]


def detect(template_source: str) -> str | None:
    """The parser a chat template's text implies: the format it shows the model, or None."""
    if "<tool_call>" in template_source:
        return Hermes.name
    if "[TOOL_CALLS]" in template_source:
        return Mistral.name
    if "<|python_tag|>" in template_source or (
        "<|start_header_id|>" in template_source and '"parameters"' in template_source
    ):
        return Llama3Json.name
    return None
