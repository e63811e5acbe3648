"""Incremental detokenization: the text of a growing generation, one piece per step, without
decoding the generation (or a window of it twice) again for every token.

A `TextStream` is made per request by `text_stream(tokenizer)`. `add(ids)` returns the text the
new ids complete; text is held back while it ends inside a character (a UTF-8 sequence split
across tokens) or a tokenizer could still merge it with the next token; `flush()` returns what
is held at the end. Contract, for every tokenizer and every sequence of ids: the pieces of
`add` then `flush` concatenate to exactly `tokenizer.decode(all ids)`, and no piece is ever taken
back (each concatenation so far is a prefix of that text). One exception no stream can avoid:
byte-fallback tokens (SentencePiece) decode a run of bytes as a whole, so a later byte can turn a
character already sent into U+FFFDs (C3 A9 is "é", C3 A9 A9 three U+FFFD); the stream then goes
on after the text the two decodes share, and only that character differs from the whole decode.

By tokenizer:
- the byte tokenizer: Python's incremental UTF-8 decoder (invalid bytes become U+FFFD at once,
  as `bytes.decode(errors="replace")` does, instead of being held);
- a `tokenizers` tokenizer: its Rust `DecodeStream` (tokenizers >= 0.21), one call per token;
- any other, or where DecodeStream gives up (it refuses a window whose text does not extend the
  previous one): vLLM's prefix/read offsets, two decodes of a few tokens per step.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any, Protocol

from common.model.config import BYTE_VOCAB
from common.model.tokenizer import ByteTokenizer, HFTokenizer

_CONTEXT = 4  # ids before the first unread one decoded again as context (window mode)


class TextStream(Protocol):
    def add(self, ids: Sequence[int]) -> str:
        """The text the new `ids` complete ("" while held back)."""

    def flush(self) -> str:
        """The text still held back; call once, at the end of the generation."""


def text_stream(tokenizer: Any) -> TextStream:
    """A fresh TextStream for one generation decoded by `tokenizer`."""
    if isinstance(tokenizer, ByteTokenizer):
        return Utf8Stream()
    if isinstance(tokenizer, HFTokenizer):
        return RustStream(tokenizer)
    return WindowStream(tokenizer)


class Utf8Stream:
    """ByteTokenizer: ids below 256 are UTF-8 bytes, the rest (specials) are dropped."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(bytes(i for i in ids if 0 <= i < BYTE_VOCAB))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class WindowStream:
    """vLLM's incremental detokenizer over any `decode(ids)`: decode ids[prefix:] and
    ids[prefix:read], emit the difference once it does not end in U+FFFD; then the window moves
    up to the ids just emitted."""

    def __init__(self, tokenizer: Any, ids: Sequence[int] = (), read: int = 0) -> None:
        self._decode = tokenizer.decode
        self._ids = list(ids)
        self._read = read  # ids[:read] are emitted
        self._prefix = max(0, read - _CONTEXT)  # decoded again as context for the next piece

    def add(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True)

    def _step(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if not final and (text.endswith("\ufffd") or text == before):
            return ""
        # the new text follows the prefix's, unless a later id rewrote it (byte fallback):
        # what was sent stays sent, the rest goes out after the part the two share
        kept = len(before) if text.startswith(before) else _shared(before, text)
        self._prefix, self._read = self._read, len(self._ids)
        return text[kept:]


def _shared(a: str, b: str) -> int:
    """Length of the longest common prefix of a and b."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


class RustStream:
    """A `tokenizers` tokenizer: `DecodeStream.step` per id. The ids since the last piece are
    kept so that `flush` (or a fall back to WindowStream) can decode them."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._read = 0  # ids[:read] are emitted
        self._window: WindowStream | None = None
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # tokenizers < 0.21
            self._window = WindowStream(tokenizer)
            return
        self._stream = DecodeStream(skip_special_tokens=True)

    def add(self, ids: Sequence[int]) -> str:
        if self._window is not None:
            return self._window.add(ids)
        pieces = []
        for n, i in enumerate(ids):
            self._ids.append(i)
            try:
                piece = self._stream.step(self._tokenizer.raw, i)
            except Exception:  # DecodeStream's InvalidPrefix (a bare Exception): go on by windows
                self._window = WindowStream(self._tokenizer, self._ids, self._read)
                pieces.append(self._window.add(ids[n + 1 :]))
                return "".join(pieces)
            if piece:
                self._read = len(self._ids)
                pieces.append(piece)
        return "".join(pieces)

    def flush(self) -> str:
        if self._window is not None:
            return self._window.flush()
        return WindowStream(self._tokenizer, self._ids, self._read).flush()


__all__ = ["RustStream", "TextStream", "Utf8Stream", "WindowStream", "text_stream"]
