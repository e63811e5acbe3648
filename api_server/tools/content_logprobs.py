"""Which logprob entries of a chat choice read for tool calls belong to its `content`.

The content of such a choice is always a prefix of its text (api_server.tools.assembler): the
text before the first call, or all of it when no call is made. Its logprobs are the entries of
the tokens that begin inside that prefix, so a choice without calls has every entry (as without
tools) and a choice that is only calls has none; the tokens of the calls are not listed (their
text is not content: OpenAI lists message content tokens only).

Where each token begins is measured by decoding: a token's text is what decoding a few tokens
before it with and without it adds (a leading space that sentencepiece drops at the start of a
text counts as the whole decode counts it; a token that only completes a character begins where
that character does), which keeps the cost per token constant however long the answer.
"""

from __future__ import annotations

from collections.abc import Callable

from common.sampling_params import TokenLogprob

#: tokens decoded before each one: a character is at most 4 bytes, so 4 back holds its start
_WINDOW = 4
#: what decoding makes of a character cut short
_PART = "\ufffd"


class ContentLogprobs:
    """One choice's entries as they arrive (`add`), handed out as its content grows (`upto`).
    `decode` is the daemons' detokenization (special tokens dropped)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._entries: list[TokenLogprob] = []
        self._starts: list[int] = []  # each token's first character in the choice's text
        self._end = 0  # characters of the text the tokens so far make
        self._given = 0  # entries handed out
        self._partial = False  # the text so far ends inside a character

    def add(self, entries: list[TokenLogprob]) -> None:
        """The entries of the choice's next tokens, in order."""
        for e in entries:
            self._ids.append(e.token)
            self._entries.append(e)
            window = self._ids[-_WINDOW - 1 :]
            text = self._decode(window)
            added = len(text) - len(self._decode(window[:-1]))
            # a token that only goes on with a character the one before began begins there
            continues = added == 0 and self._partial
            self._starts.append(self._starts[-1] if continues else self._end)
            self._end += added
            self._partial = text.endswith(_PART)

    def upto(self, chars: int) -> list[TokenLogprob]:
        """The entries not handed out yet of the tokens that begin before character `chars`
        (the content's length so far)."""
        n = self._given
        while n < len(self._entries) and self._starts[n] < chars:
            n += 1
        out, self._given = self._entries[self._given : n], n
        return out

    def rest(self) -> list[TokenLogprob]:
        """Every entry not handed out yet (a choice whose whole text is content)."""
        out, self._given = self._entries[self._given :], len(self._entries)
        return out
