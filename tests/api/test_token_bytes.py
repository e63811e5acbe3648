"""The `bytes` of a token in chat logprobs are the token's own bytes, not those of its text: a
token that holds part of a character (byte-level BPE, byte fallback, the byte tokenizer) gives
its raw bytes, so the content tokens' bytes joined are the UTF-8 of the text, as OpenAI's are."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from api_server.logprobs import LogprobFormat
from api_server.tokens import PromptCounter
from common.sampling_params import TokenLogprob
from tests.support.smollm2 import smollm2_dir

TEXTS = [
    "😀🎉🥳",
    "Here you go: 😊 😄 🙂!",
    "Ça va? Très bien — 東京 🚀",
    "plain ascii",
]


def _byte_fallback_checkpoint(path: Path) -> Path:
    """A SentencePiece-style tokenizer.json (Llama's decoder: ▁ as space, byte fallback): a few
    letters and the 256 byte tokens, so every other character is spelled as `<0xNN>` bytes."""
    path.mkdir()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {c: len(vocab) + i for i, c in enumerate("▁Hiaeiou")}
    tok = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(params=["smollm2", "byte-fallback", "byte-tokenizer"])
def counter(request: pytest.FixtureRequest, tmp_path: Path) -> PromptCounter:
    if request.param == "smollm2":
        return PromptCounter(smollm2_dir())
    if request.param == "byte-fallback":
        return PromptCounter(_byte_fallback_checkpoint(tmp_path / "sp"))
    return PromptCounter(None)


def _content_ids(counter: PromptCounter, text: str) -> list[int]:
    """The ids of `text` without the tokenizer's BOS (the byte tokenizer's is 256)."""
    ids = counter.encode(text)
    return ids[1:] if counter.decode(ids[:1]) == "" else ids


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_joined_are_the_texts_utf8(counter: PromptCounter, text: str) -> None:
    ids = _content_ids(counter, text)
    assert counter.decode(ids) == text  # the tokenizer round-trips the text itself
    if text != "plain ascii":
        split = [i for i in ids if "\ufffd" in counter.token(i)[0]]
        assert split, "no token holds part of a character: the case is not exercised"
    assert b"".join(bytes(counter.token(i)[1]) for i in ids) == text.encode()


def test_chat_logprobs_bytes_of_emojis(counter: PromptCounter) -> None:
    """What "Reply with three happy emojis only." answers with `logprobs`, `top_logprobs: 2`."""
    text = "😀😄😊"
    ids = _content_ids(counter, text)
    entries = [TokenLogprob(i, -0.5, [(i, -0.5), (ids[0], -1.5)]) for i in ids]
    content = LogprobFormat(counter).chat(entries)["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == text.encode()
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)
    assert all(bytes(c["bytes"]) != "\ufffd".encode() for c in content)
