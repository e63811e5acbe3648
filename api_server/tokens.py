"""Prompt token counts for usage when the API itself ended a request (a stop string): the daemon's
FINISH, which carries the count, never comes for an aborted request.

It counts as the daemons' tokenizers encode (common.model.tokenizer): the checkpoint's
tokenizer.json with its special-token template, or BOS + the UTF-8 bytes for the byte tokenizer.
It loads `tokenizers` alone, not the model package (which imports torch), to keep the HTTP
process small.
"""

from __future__ import annotations

from pathlib import Path


class PromptCounter:
    def __init__(self, model_dir: Path | None) -> None:
        path = model_dir / "tokenizer.json" if model_dir is not None else None
        self._tok = None
        if path is not None and path.is_file():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(path))

    def count(self, prompt: str | None, prompt_tokens: list[int] | None) -> int:
        """Tokens the daemons made of this prompt (ids are counted as given)."""
        if prompt_tokens is not None:
            return len(prompt_tokens)
        assert prompt is not None
        if self._tok is None:
            return 1 + len(prompt.encode("utf-8"))
        return len(self._tok.encode(prompt, add_special_tokens=True).ids)
