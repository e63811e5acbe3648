"""Tokenizers behind one small interface: the built-in byte tokenizer and a `tokenizers` adapter.

Interface (structural, `Tokenizer`): `encode(text) -> list[int]` (BOS first when the tokenizer has
one), `decode(ids) -> str` (special ids dropped, invalid UTF-8 replaced), `bos_token_id`,
`eos_token_id`, and `name`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from common.errors import ModelError
from common.model.config import BYTE_VOCAB, TINY_BOS, TINY_EOS


@runtime_checkable
class Tokenizer(Protocol):
    """What the daemons need from a tokenizer."""

    name: str
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS and EOS are ids above them (256 and 257 by default)."""

    name = "bytes"

    def __init__(self, *, bos_token_id: int = TINY_BOS, eos_token_id: int = TINY_EOS) -> None:
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_id: int | None = eos_token_id

    def encode(self, text: str) -> list[int]:
        """BOS followed by the UTF-8 bytes of `text`."""
        return [self.bos_token_id, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """Bytes of the ids below 256 as UTF-8 (invalid sequences become U+FFFD); specials dropped."""
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


class HFTokenizer:
    """Adapter over a `tokenizers` tokenizer.json (the fast tokenizer every HF checkpoint ships)."""

    def __init__(
        self, path: str | Path, *, bos_token_id: int | None, eos_token_id: int | None
    ) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ModelError(f"cannot read tokenizer {path}: {exc}") from exc
        self.name = f"tokenizers:{path.parent.name}"
        special = _special_tokens(path.parent / "tokenizer_config.json")
        bos, eos = self._id_of(special.get("bos_token")), self._id_of(special.get("eos_token"))
        self.bos_token_id = bos if bos is not None else bos_token_id
        self.eos_token_id = eos if eos is not None else eos_token_id

    def encode(self, text: str) -> list[int]:
        """Ids of `text` with the tokenizer's own special-token template (usually a leading BOS)."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def raw(self) -> Any:
        """The `tokenizers.Tokenizer` itself (common.model.detokenizer streams through it)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce: its vocabulary and added tokens."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)


def _special_tokens(path: Path) -> dict[str, str]:
    """bos_token / eos_token strings from tokenizer_config.json (plain or AddedToken dicts)."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot parse {path}: {exc}") from exc
    out: dict[str, str] = {}
    for key in ("bos_token", "eos_token"):
        value = raw.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out
