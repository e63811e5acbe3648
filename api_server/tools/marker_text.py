"""An answer's text with the tool-call markers that are special tokens put back.

The daemons decode with special tokens dropped, and in Mistral's tokenizers `[TOOL_CALLS]`,
`[ARGS]` and `[CALL_ID]` are special (in Llama 3's, `<|python_tag|>`): without them
`Sure.[TOOL_CALLS]get_time[ARGS]{}` arrives as `Sure.get_time{}`, where no parser can tell the
text from the call. For a choice read by such a parser the API therefore decodes the ids itself:
the ids between two markers as the daemons decode them, each marker as its own text.

Decoding is incremental (the text of the ids since the last marker, decoded from a few ids
before the new ones, so each step costs what the new ids cost): text that ends inside a
character waits for the ids that complete it. A run of ids after a marker is decoded from its
start, so a tokenizer that drops a leading space at the start of a text (sentencepiece) drops
it there too: the parsers skip whitespace where a call begins.
"""

from __future__ import annotations

from collections.abc import Callable

#: what decoding makes of a character cut short
_PART = "\ufffd"


class MarkerText:
    """Text deltas of one choice's ids. `decode`: the daemons' decoding (special tokens
    dropped); `markers`: the ids to write as their text. feed() per frame of ids, flush() at
    the end. One per choice."""

    def __init__(self, decode: Callable[[list[int]], str], markers: dict[int, str]) -> None:
        self._decode = decode
        self._markers = markers
        self._ids: list[int] = []  # since the last marker
        self._prefix = 0  # decoding starts here (context for the ids after _read)
        self._read = 0  # the ids before this are sent

    def feed(self, ids: list[int]) -> str:
        """The text that `ids`, the choice's next ids, make safe to send."""
        out = []
        for token in ids:
            marker = self._markers.get(token)
            if marker is None:
                self._ids.append(token)
                continue
            out += [self.flush(), marker]
        out.append(self._new(final=False))
        return "".join(out)

    def flush(self) -> str:
        """The text of every id fed and not sent yet (a character cut short as U+FFFD, as the
        daemons write it); the next ids start a new run."""
        text = self._new(final=True)
        self._ids, self._prefix, self._read = [], 0, 0
        return text

    def _new(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        if not final and now.endswith(_PART):
            return ""  # wait for the rest of the character
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before) :]
