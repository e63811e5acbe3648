"""Prompt token counts for usage when the API itself ended a request (a stop string): the daemon's
FINISH, which carries the count, never comes for an aborted request.

It counts as the daemons' tokenizers encode (common.model.tokenizer): the checkpoint's
tokenizer.json with its special-token template, or BOS + the UTF-8 bytes for the byte tokenizer.
It loads `tokenizers` alone, not the model package (which imports torch), to keep the HTTP
process small.
"""

from __future__ import annotations

from pathlib import Path

from api_server.token_bytes import TokenBytes

_BYTE_BOS = 256  # common.model.config.TINY_BOS (not imported: it imports torch)
_BYTE_SPECIALS = {256: "<s>", 257: "</s>", 258: "<pad>"}


class PromptCounter:
    """The daemons' tokenizer as the API needs it: prompt counts, ids of an echoed prompt, the
    text and bytes of a token in logprobs."""

    def __init__(self, model_dir: Path | None) -> None:
        path = model_dir / "tokenizer.json" if model_dir is not None else None
        self._tok = None
        self._bytes: TokenBytes | None = None
        if path is not None and path.is_file():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(path))
            self._bytes = TokenBytes(self._tok)

    def count(self, prompt: str | None, prompt_tokens: list[int] | None) -> int:
        """Tokens the daemons made of this prompt (ids are counted as given)."""
        if prompt_tokens is not None:
            return len(prompt_tokens)
        assert prompt is not None
        return len(self.encode(prompt))

    def encode(self, prompt: str) -> list[int]:
        """The ids the daemons make of `prompt`."""
        if self._tok is None:
            return [_BYTE_BOS, *prompt.encode("utf-8")]
        return list(self._tok.encode(prompt, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` as the daemons write it (special tokens left out)."""
        if self._tok is None:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self._tok.decode(ids, skip_special_tokens=True)

    def has_token(self, text: str) -> bool:
        """True when the tokenizer has `text` as one token (the byte tokenizer has none)."""
        return self._tok is not None and self._tok.token_to_id(text) is not None

    def special_ids(self, texts: tuple[str, ...]) -> dict[int, str]:
        """The ids of those of `texts` that are special tokens (dropped from the daemons'
        text), each with its text."""
        if self._tok is None:
            return {}
        added = self._tok.get_added_tokens_decoder()
        return {i: t.content for i, t in added.items() if t.special and t.content in texts}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """One token as logprobs show it: its text (special tokens by name; a part of a
        character as U+FFFD) and its own bytes (api_server.token_bytes), the part included."""
        if self._tok is None:
            if 0 <= token_id < 256:
                raw = bytes([token_id])
                return raw.decode("utf-8", errors="replace"), list(raw)
            text = _BYTE_SPECIALS.get(token_id, f"<|{token_id}|>")
            return text, list(text.encode())
        assert self._bytes is not None
        text = self._tok.decode([token_id], skip_special_tokens=False)
        return text, list(self._bytes(token_id))
