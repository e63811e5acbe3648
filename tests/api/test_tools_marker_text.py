"""The answer's text with a parser's special-token markers put back (api_server.tools.marker_text)
on the Mistral v11 test tokenizer: the text between markers is the daemons' decoding, whatever
frames the ids come in, a character split over ids waits for its end, and the markers are
found from the tokenizer (special tokens only)."""

from __future__ import annotations

import pytest

from api_server.tokens import PromptCounter
from api_server.tools.marker_text import MarkerText
from api_server.tools.parsers import MistralV11
from tests.support.tool_checkpoint import (
    MISTRAL_V11,
    MISTRAL_V11_TEMPLATE,
    QWEN,
    write_byte_tokenizer,
)


@pytest.fixture(scope="module")
def counter(tmp_path_factory: pytest.TempPathFactory) -> PromptCounter:
    path = tmp_path_factory.mktemp("mistral")
    write_byte_tokenizer(path, MISTRAL_V11_TEMPLATE, MISTRAL_V11)
    return PromptCounter(path)


def test_the_markers_are_the_special_tokens_of_the_format(
    counter: PromptCounter, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert counter.special_ids(MistralV11.specials) == {
        3: "[TOOL_CALLS]",
        4: "[ARGS]",
        5: "[CALL_ID]",
    }
    assert counter.has_token("[ARGS]") and not counter.has_token("[NOPE]")
    qwen = tmp_path_factory.mktemp("qwen")
    write_byte_tokenizer(qwen, vocab_spec=QWEN)
    # Qwen's <tool_call> is an added token that is not special: the daemons' text keeps it
    assert PromptCounter(qwen).special_ids(("<tool_call>", "</tool_call>")) == {}
    assert PromptCounter(None).special_ids(MistralV11.specials) == {}


@pytest.mark.parametrize("frame", [1, 2, 5, 1000])
def test_text_between_markers_is_the_daemons_whatever_the_frames(
    counter: PromptCounter, frame: int
) -> None:
    markers = counter.special_ids(MistralV11.specials)
    text = 'Ça fait 5€ — [TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]g[ARGS]{}'
    ids = counter.encode(text)  # the special tokens are split off as in a model's output
    assert 3 in ids and 4 in ids
    marked = MarkerText(counter.decode, markers)
    pieces = [marked.feed(ids[i : i + frame]) for i in range(0, len(ids), frame)]
    assert "".join(pieces) + marked.flush() == text
    assert not any("\ufffd" in p for p in pieces)  # a split character waits for its end
    assert counter.decode(ids) == text.replace("[TOOL_CALLS]", "").replace("[ARGS]", "")


def test_a_character_cut_short_at_the_end_is_written_as_the_daemons_write_it(
    counter: PromptCounter,
) -> None:
    ids = counter.encode("a€")[:-1]  # the euro sign's last byte never came
    marked = MarkerText(counter.decode, {})
    assert marked.feed(ids[:1]) == "a"
    assert marked.feed(ids[1:]) == ""  # it may still come
    assert marked.flush() == counter.decode(ids)[1:] == "\ufffd"
