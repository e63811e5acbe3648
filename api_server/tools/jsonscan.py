"""Where JSON values end in text that is still arriving: the tool-call parsers read a model's
output a token at a time and must tell a value that is complete from one that is not yet, and
both from text that can never be JSON.

Nothing here builds Python values but keys and names (json.loads of a complete string): a call's
arguments are passed on as the model wrote them, byte for byte.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WS = " \t\n\r"
_SCALAR_END = ",}] \t\n\r;"
_SCALARS = ("true", "false", "null")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?\Z")


class Malformed(ValueError):
    """The text at this point cannot be JSON, whatever follows it."""


def skip_ws(text: str, i: int) -> int:
    """The index of the first character at or after `i` that is not JSON whitespace."""
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value that starts at `text[i]`, None while it is incomplete;
    Malformed when no value can start there. Strings and brackets are matched, not validated
    (the caller json.loads the span once it is complete)."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        return _bracket_end(text, i)
    if c in "-0123456789tfn":
        j = i
        while j < len(text) and text[j] not in _SCALAR_END:
            j += 1
        if j == len(text):
            return None  # a number may go on; true/false/null may be unfinished
        word = text[i:j]
        if word in _SCALARS or _is_number(word):
            return j
        raise Malformed(f"not a JSON value: {word[:40]!r}")
    raise Malformed(f"a JSON value cannot start with {c!r}")


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _bracket_end(text: str, i: int) -> int | None:
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _is_number(word: str) -> bool:
    return _NUMBER.match(word) is not None


@dataclass
class ObjectScan:
    """What is known of a JSON object whose text may be cut short: each key seen, with the span
    of its value (end None while the value is incomplete), and the object's end once it is
    complete."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None

    def string(self, text: str, key: str) -> str | None:
        """The value of `key` when it is a complete JSON string, else None."""
        span = self.fields.get(key)
        if span is None or span[1] is None or text[span[0]] != '"':
            return None
        return json.loads(text[span[0] : span[1]])


def scan_object(text: str, i: int) -> ObjectScan:
    """Scan the object that starts at `text[i]` (a `{`) as far as `text` goes; Malformed when
    it cannot be an object."""
    if i >= len(text) or text[i] != "{":
        raise Malformed("expected a JSON object")
    scan = ObjectScan()
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        scan.end = j + 1
        return scan
    while j < len(text):
        if text[j] != '"':
            raise Malformed("expected a key")
        key_end = _string_end(text, j)
        if key_end is None:
            return scan
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j == len(text):
            return scan
        if text[j] != ":":
            raise Malformed("expected ':' after a key")
        j = skip_ws(text, j + 1)
        if j == len(text):
            return scan
        end = value_end(text, j)
        scan.fields[key] = (j, end)
        if end is None:
            return scan
        j = skip_ws(text, end)
        if j == len(text):
            return scan
        if text[j] == "}":
            scan.end = j + 1
            return scan
        if text[j] != ",":
            raise Malformed("expected ',' or '}' in an object")
        j = skip_ws(text, j + 1)
    return scan
