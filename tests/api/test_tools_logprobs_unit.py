"""Which logprob entries are a tool-read choice's content (api_server.tools.content_logprobs),
with real tokenizers: the byte-level one of the tool checkpoint (a character over several
tokens) and SmolLM2's BPE."""

from __future__ import annotations

import pytest

from api_server.tokens import PromptCounter
from api_server.tools.assembler import ToolAssembler
from api_server.tools.content_logprobs import ContentLogprobs
from api_server.tools.parsers import Hermes
from common.sampling_params import TokenLogprob
from tests.support.smollm2 import smollm2_dir
from tests.support.tool_checkpoint import write_byte_tokenizer


@pytest.fixture(scope="module")
def counter(tmp_path_factory: pytest.TempPathFactory) -> PromptCounter:
    path = tmp_path_factory.mktemp("bytes")
    write_byte_tokenizer(path)
    return PromptCounter(path)


def entries(ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(token=t, logprob=-float(i)) for i, t in enumerate(ids)]


def content_ids(counter: PromptCounter, text: str, pieces: int) -> tuple[list[int], list[int]]:
    """(ids of `text`, the ids of its content as the assembler reads it) fed in `pieces`."""
    ids = counter.encode(text)
    asm, content = ToolAssembler(Hermes()), ContentLogprobs(counter.decode)
    got: list[int] = []
    step = max(1, len(ids) // pieces)
    decoded = 0
    for i in range(0, len(ids), step):
        content.add(entries(ids[i : i + step]))
        whole = counter.decode(ids[: i + step])
        asm.feed(whole[decoded:])
        decoded = len(whole)
        got += [e.token for e in content.upto(asm.content_chars)]
    asm.finish("stop")
    tail = content.upto(asm.content_chars) if asm.called else content.rest()
    return ids, got + [e.token for e in tail]


@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_content_is_the_tokens_before_the_call_whatever_the_pieces(
    counter: PromptCounter, pieces: int
) -> None:
    prefix = "Ça coûte 5€ — "
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    ids, got = content_ids(counter, prefix + call, pieces)
    assert counter.decode(got) == prefix
    assert got == ids[: len(counter.encode(prefix))]
    ids, got = content_ids(counter, prefix + "no call at all", pieces)
    assert got == ids  # all of it: no call was made


def test_a_token_that_completes_a_character_belongs_where_it_began(
    counter: PromptCounter,
) -> None:
    content = ContentLogprobs(counter.decode)
    ids = counter.encode("a€")  # 1 + 3 byte tokens
    assert len(ids) == 4
    content.add(entries(ids))
    assert [e.token for e in content.upto(1)] == ids[:1]
    assert [e.token for e in content.upto(2)] == ids[1:]


def test_bpe_tokens_with_leading_spaces() -> None:
    counter = PromptCounter(smollm2_dir())
    prefix = "Let me look that up for you. "
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for text in (prefix + call, prefix.strip() + "\n" + call):
        ids, got = content_ids(counter, text, 1000)
        content = text[: text.index("<")]
        # the tokens that begin in the content: they cover it, the last one may run past it
        assert counter.decode(got).startswith(content), text
        assert len(counter.decode(got[:-1])) < len(content), text
        assert got == ids[: len(got)]
