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
#: The rest of a string after its opening quote, closing quote included.
_STRING_REST = re.compile(r'(?:[^"\\]|\\.)*"', re.DOTALL)
#: What changes the depth of a value, and whole strings (so their brackets do not count); a
#: string not closed yet matches as its lone quote.
_STRUCTURAL = re.compile(r'"(?:[^"\\]|\\.)*"|"|[{}\[\]]', re.DOTALL)
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?\Z")


class Malformed(ValueError):
    """The text at this point cannot be JSON, whatever follows it."""


def skip_ws(text: str, i: int) -> int:
    """The index of the first character at or after `i` that is not JSON whitespace."""
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


#: Where the scan of an unfinished object or array that starts at an index stopped: (the index
#: to resume at, the depth there). Valid while the text only grows at its end.
Memo = dict[int, tuple[int, int]]


def value_end(text: str, i: int, memo: Memo | None = None) -> int | None:
    """The index just past the JSON value that starts at `text[i]`, None while it is incomplete;
    Malformed when no value can start there. Strings and brackets are matched, not validated
    (the caller json.loads the span once it is complete). With a `memo` kept for one text that
    only grows, an unfinished object or array is scanned on from where it stopped."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        return _bracket_end(text, i, {} if memo is None else memo)
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
    m = _STRING_REST.match(text, i + 1)
    return None if m is None else m.end()


def _bracket_end(text: str, i: int, memo: Memo) -> int | None:
    pos, depth = memo.get(i, (i, 0))
    for m in _STRUCTURAL.finditer(text, pos):
        c = m.group()
        if c == '"':
            memo[i] = (m.start(), depth)  # a string not closed yet: scan it again
            return None
        if c[0] == '"':
            continue  # a whole string: its brackets do not count
        if c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                memo.pop(i, None)
                return m.end()
    memo[i] = (len(text), depth)  # nothing structural after the last match
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


def scan_object(text: str, i: int, memo: Memo | None = None) -> ObjectScan:
    """Scan the object that starts at `text[i]` (a `{`) as far as `text` goes; Malformed when
    it cannot be an object. `memo`: as value_end's."""
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
        end = value_end(text, j, memo)
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
