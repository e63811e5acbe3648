"""The raw bytes of a token of a `tokenizers` tokenizer.json, as OpenAI's chat logprobs give
them in `bytes`: a token that holds part of a character has that part, so the bytes of a
choice's tokens joined are the UTF-8 of its text (the token's decoded text would be U+FFFD).

- byte-level BPE (GPT-2, SmolLM2, Llama 3: a `ByteLevel` decoder): each character of the
  token's string stands for one byte through GPT-2's byte-to-unicode table;
- byte fallback (SentencePiece, Llama 2, TinyLlama: a `ByteFallback` decoder): a `<0xNN>` token
  is the byte NN, and `▁` in the others is a space;
- added tokens (specials) and any other tokenizer: the UTF-8 of the token's decoded text.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "▁"  # SentencePiece's word boundary, a space in the text


@cache
def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's map from the characters byte-level BPE writes for bytes back to the bytes: the
    printable Latin-1 ones stand for themselves, the other 68 bytes for 256, 257, ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: b for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = 256 + extra
    return {chr(c): b for b, c in chars.items()}


def _decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    """The types of a tokenizer.json decoder, those inside a `Sequence` included."""
    if not decoder:
        return set()
    inner = decoder.get("decoders") or []
    return {decoder.get("type", ""), *(t for d in inner for t in _decoder_types(d))}


class TokenBytes:
    """The bytes of each id of one `tokenizers.Tokenizer` (module docstring)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        spec = json.loads(tok.to_str())
        self._added = {t["id"] for t in spec.get("added_tokens") or ()}
        kinds = _decoder_types(spec.get("decoder"))
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds

    def __call__(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is not None and token_id not in self._added:
            if self._byte_level:
                table = gpt2_byte_decoder()
                if all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
            elif self._byte_fallback:
                if m := _BYTE_TOKEN.fullmatch(piece):
                    return bytes([int(m.group(1), 16)])
                return piece.replace(_SPACE, " ").encode()
        return self._tok.decode([token_id], skip_special_tokens=False).encode()
