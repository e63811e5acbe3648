"""Grammars over texts that contain added tokens (issue 42): with Qwen's kind of tokenizer
(tests/support/tool_checkpoint.py: `<tool_call>` an added token the decoder keeps in the text),
a grammar whose text contains `<tool_call>` lets the token through and advances past it, the
text spelled byte by byte is the same text; the special tokens (EOS, `<|im_start|>`) and the ids
past the tokenizer's stay out of any text (a special token's name in a grammar's text is its
bytes), a Lark grammar's special-token reference still means the token; and for a tokenizer
whose added tokens are all special the view is llguidance's own, token for token."""

from __future__ import annotations

import json

import llguidance
import pytest

from common.model.tokenizer import HFTokenizer
from common.sampling_params import StructuredOutput
from common.structured import GrammarCache, bitmask, grammars_for
from common.structured.grammar import _added, _from_json
from tests.support.tool_checkpoint import VOCAB, write_byte_tokenizer

#: the model's width: 4 ids past the tokenizer's 300, as a padded embedding has
WIDTH, EOS, IM_START, ENDOFTEXT = VOCAB + 4, 2, 1, 0
CALL, END_CALL, UNUSED = 259, 260, 261


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return write_byte_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def cache(tok, tmp_path_factory: pytest.TempPathFactory) -> GrammarCache:  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("hf")
    (d / "tokenizer.json").write_text(tok.to_str())
    hf = HFTokenizer(d / "tokenizer.json", bos_token_id=None, eos_token_id=None)
    return grammars_for(hf, WIDTH, {EOS})


def _allowed(m) -> list[int]:  # type: ignore[no-untyped-def]
    mask = bitmask.allocate(1, WIDTH)
    mask.zero_()
    m.fill(mask, 0)
    return bitmask.allowed(mask, WIDTH)[0].nonzero().flatten().tolist()


def _ids(tok, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return list(tok.encode(text, add_special_tokens=False).ids)


def test_the_tokenizer_has_what_the_tests_need(tok) -> None:  # type: ignore[no-untyped-def]
    assert tok.token_to_id("<tool_call>") == CALL and tok.token_to_id("</tool_call>") == END_CALL
    assert _ids(tok, "a<tool_call>b") == [_ids(tok, "a")[0], CALL, _ids(tok, "b")[0]]
    assert tok.decode([CALL], skip_special_tokens=True) == "<tool_call>"  # kept: not special
    assert tok.decode([EOS], skip_special_tokens=True) == ""
    special = {ENDOFTEXT: "<|endoftext|>", IM_START: "<|im_start|>", EOS: "<|im_end|>"}
    assert _added(tok.to_str()) == (special, set(range(CALL, VOCAB)))


def test_added_token_in_a_regex_is_allowed_and_accepted(tok, cache: GrammarCache) -> None:  # type: ignore[no-untyped-def]
    """Issue 42's reproduction: the mask allowed `<tool_call>` and accepting it failed."""
    m = cache.compile(StructuredOutput("regex", "a<tool_call>b")).matcher()
    assert m.accept(_ids(tok, "a")[0])
    assert CALL in _allowed(m)
    assert m.accept(CALL), m.error
    assert _allowed(m) == _ids(tok, "b")
    assert m.accept(_ids(tok, "b")[0]) and m.terminated
    assert _allowed(m) == [EOS]


def test_the_text_spelled_in_bytes_is_the_same_text(tok, cache: GrammarCache) -> None:  # type: ignore[no-untyped-def]
    m = cache.compile(StructuredOutput("regex", "a<tool_call>b")).matcher()
    spelled = [tok.token_to_id(tok.id_to_token(i)) for i in _ids(tok, "a")]
    spelled += [_ids(tok, c)[0] for c in "<tool_call>b"]
    assert CALL not in spelled and len(spelled) == len("a<tool_call>b")
    for t in spelled:
        assert m.accept(t), (t, m.error)
    assert m.terminated


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutput("regex", r'<tool_call>\{"n": [0-9]\}</tool_call>'),
        StructuredOutput("choice", json.dumps(['<tool_call>{"n": 7}</tool_call>', "no"])),
        StructuredOutput("grammar", 'start: "<tool_call>" "{\\"n\\": " /[0-9]/ "}</tool_call>"'),
    ],
)
def test_every_kind_takes_both_markers(tok, cache: GrammarCache, structured) -> None:  # type: ignore[no-untyped-def]
    m = cache.compile(structured).matcher()
    for t in _ids(tok, '<tool_call>{"n": 7}</tool_call>'):
        assert t in _allowed(m), t
        assert m.accept(t), (t, m.error)
    assert m.terminated and _allowed(m) == [EOS]


def test_special_tokens_and_padding_stay_out_of_text(tok, cache: GrammarCache) -> None:  # type: ignore[no-untyped-def]
    """Any text (`.*`): every printable ASCII byte and every plain added token, EOS as its end
    (the text may end anywhere), never `<|im_start|>`/`<|endoftext|>` (special: no text) nor ids
    past the tokenizer's."""
    anything = _allowed(cache.compile(StructuredOutput("regex", "(.|\n)*")).matcher())
    printable = {_ids(tok, chr(c))[0] for c in range(0x21, 0x7F)}
    assert printable | set(range(CALL, VOCAB)) <= set(anything)
    assert EOS in anything
    assert not {ENDOFTEXT, IM_START, *range(VOCAB, WIDTH)} & set(anything)


def test_a_special_tokens_name_in_a_grammars_text_is_its_bytes(tok, cache: GrammarCache) -> None:  # type: ignore[no-untyped-def]
    """The name `<|im_start|>` in a regex is text: its bytes, never the special token (which
    llguidance's own reading allowed there, then refused: the answer ended)."""
    compiled = cache.compile(StructuredOutput("regex", "<\\|im_start\\|>x"))
    assert not compiled.matcher().accept(IM_START)
    m = compiled.matcher()
    assert _allowed(m) == _ids(tok, "<")
    for c in "<|im_start|>x":
        assert m.accept(_ids(tok, c)[0]), (c, m.error)
    assert m.terminated


def test_a_lark_special_token_reference_is_the_token(cache: GrammarCache) -> None:
    """Lark's bare `<|im_start|>` names the special token itself (llguidance's syntax)."""
    m = cache.compile(StructuredOutput("grammar", 'start: <|im_start|> "x"')).matcher()
    assert _allowed(m) == [IM_START]
    assert m.accept(IM_START), m.error


def test_with_only_special_added_tokens_it_is_llguidances_own_view(tok) -> None:  # type: ignore[no-untyped-def]
    """Where every added token is special (SmolLM2, Llama) each id's bytes and specialness are
    llguidance's own reading of the JSON, the one transformers + llguidance.hf.from_tokenizer
    give (tests/model/test_structured_smollm2.py's oracle); text is spelled the same but for a
    special token's name."""
    spec = json.loads(tok.to_str())
    for t in spec["added_tokens"]:
        t["special"] = True
    text = json.dumps(spec)
    ours = _from_json(llguidance, text, WIDTH, [EOS])
    theirs = llguidance.LLTokenizer(text, n_vocab=WIDTH, eos_token=[EOS])
    for i in range(WIDTH):
        assert ours.is_special_token(i) == theirs.is_special_token(i), i
        assert ours.decode_bytes([i]) == theirs.decode_bytes([i]), i
    assert ours.is_special_token(CALL)  # special in this JSON
    for words in ["a b", 'x {"k": [1, 2]}\n', "héllo"]:
        assert ours.tokenize_str(words) == theirs.tokenize_str(words), words
    for name, i in (("<|im_end|>", EOS), ("<tool_call>", CALL)):  # both special here
        assert theirs.tokenize_str(f"a{name}") == [_ids(tok, "a")[0], i]
        assert ours.tokenize_str(f"a{name}") == _ids(tok, "a") + [_ids(tok, c)[0] for c in name]
