"""Tool-call parsers on fixed texts of each family's format: the calls and the content they find,
the same whether the text comes whole, a character at a time or in uneven pieces, and the
streamed deltas in OpenAI's order (name first, then arguments fragments that add up)."""

from __future__ import annotations

import json

import pytest

from api_server.tools.assembler import ToolAssembler, fold
from api_server.tools.jsonscan import Malformed, scan_object, value_end
from api_server.tools.parsers import (
    PARSERS,
    Forced,
    Mistral,
    MistralV11,
    ToolParser,
    detect,
    parser_for,
)

WEATHER = '{"city": "Paris", "days": [1, 2], "unit": {"c": true}}'
TRICKY = '{"q": "a}b[\\"{ \\\\", "n": [1, {"x": "]"}], "e": -1.5e3}'  # brackets in strings

# (parser, text, content, [(name, arguments)], finish reason of an answer that ended by itself)
CASES = [
    ("hermes", "Hello there.", "Hello there.", [], "stop"),
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER)],
        "tool_calls",
    ),
    (
        "hermes",
        'Let me look. <tool_call>{"arguments": {"q": "a<b"}, "name": "search"}</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me look. ",
        [("search", '{"q": "a<b"}'), ("get_time", "{}")],
        "tool_calls",
    ),
    (
        "hermes",
        f'<tool_call>{{"name": "f", "arguments": {TRICKY}}}</tool_call>',
        None,
        [("f", TRICKY)],
        "tool_calls",
    ),
    (  # quoted arguments (some models): the object inside
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        None,
        [("f", '{"x": 1}')],
        "tool_calls",
    ),
    (
        "hermes",
        "<tool_call>not json</tool_call> ok",
        "<tool_call>not json</tool_call> ok",
        [],
        "stop",
    ),
    ("hermes", "a <tool_c", "a <tool_c", [], "stop"),  # a marker's start that never became one
    (
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
        "stop",
    ),
    (
        "llama3_json",
        f'{{"name": "get_weather", "parameters": {WEATHER}}}',
        None,
        [("get_weather", WEATHER)],
        "tool_calls",
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        None,
        [("a", '{"x": 1}'), ("b", "{}")],
        "tool_calls",
    ),
    ("llama3_json", '  {"answer": 42}', '  {"answer": 42}', [], "stop"),  # JSON, not a call
    ("llama3_json", 'Use {"name": "x"} later', 'Use {"name": "x"} later', [], "stop"),
    (
        "mistral",
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "g", "arguments": {{}}}}]',
        None,
        [("get_weather", WEATHER), ("g", "{}")],
        "tool_calls",
    ),
    (  # [TOOL_CALLS] is a special token the daemons' text drops
        "mistral",
        ' [{"name": "g", "arguments": {"k": "v"}}]',
        None,
        [("g", '{"k": "v"}')],
        "tool_calls",
    ),
    ("mistral", "[1, 2] is a list", "[1, 2] is a list", [], "stop"),
    # Mistral's v11 form, read by both mistral parsers: [TOOL_CALLS]name[ARGS]{...} per call
    (
        "mistral_v11",
        f"Checking.[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]g[ARGS]{{}}",
        "Checking.",
        [("get_weather", WEATHER), ("g", "{}")],
        "tool_calls",
    ),
    (
        "mistral",
        f"[TOOL_CALLS]f[ARGS]{TRICKY}",
        None,
        [("f", TRICKY)],
        "tool_calls",
    ),
    (  # v13's call id is read and dropped (the API makes its own); whitespace between calls
        "mistral_v11",
        '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "UTC"}\n[TOOL_CALLS] g[ARGS] {}',
        None,
        [("get_time", '{"tz": "UTC"}'), ("g", "{}")],
        "tool_calls",
    ),
    (  # text after the calls is dropped
        "mistral_v11",
        "[TOOL_CALLS]g[ARGS]{} and then some",
        None,
        [("g", "{}")],
        "tool_calls",
    ),
    (  # a v11 message that opens with [ is text; the older parser reads it as calls
        "mistral_v11",
        '[{"name": "g", "arguments": {}}]',
        '[{"name": "g", "arguments": {}}]',
        [],
        "stop",
    ),
    ("mistral_v11", "[TOOL_CALLS]no name here", "[TOOL_CALLS]no name here", [], "stop"),
    ("mistral_v11", "[TOOL_CALLS]g{}", "[TOOL_CALLS]g{}", [], "stop"),  # no [ARGS]
    ("mistral_v11", "[TOOL_CALLS]get_ti", "[TOOL_CALLS]get_ti", [], "stop"),  # cut, unnamed
]
FORMATS = {**PARSERS, "mistral_v11": MistralV11}


def run(parser: ToolParser, pieces: list[str], reason: str = "stop") -> tuple[list[dict], str]:
    asm = ToolAssembler(parser)
    deltas = [d for p in pieces for d in asm.feed(p)]
    last, finish = asm.finish(reason)
    return deltas + last, finish


def calls_of(message: dict) -> list[tuple[str, str]]:
    return [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]


def splits(text: str) -> list[list[str]]:
    """The text whole, a character at a time, and in pieces of 3 and 7."""
    return [
        [text],
        list(text),
        [text[i : i + 3] for i in range(0, len(text), 3)],
        [text[i : i + 7] for i in range(0, len(text), 7)],
    ]


@pytest.mark.parametrize(("name", "text", "content", "calls", "reason"), CASES)
def test_each_format_parses_the_same_whole_or_streamed(
    name: str, text: str, content: str | None, calls: list, reason: str
) -> None:
    for pieces in splits(text):
        deltas, finish = run(FORMATS[name](), pieces)
        message = fold(deltas)
        assert message["content"] == (content if content is not None or calls else "")
        assert calls_of(message) == calls
        assert finish == reason
        for _, arguments in calls_of(message):
            assert isinstance(json.loads(arguments), dict)
        assert len({c["id"] for c in message.get("tool_calls", [])}) == len(calls)


def test_stream_announces_a_call_before_its_arguments_and_holds_no_content_back_needlessly() -> (
    None
):
    text = f'Sure. <tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>'
    asm = ToolAssembler(PARSERS["hermes"]())
    seen: list[dict] = []
    for ch in text:
        seen += asm.feed(ch)
    last, finish = asm.finish("stop")
    seen += last
    assert finish == "tool_calls"
    assert [d["content"] for d in seen if "content" in d] == list("Sure. ")  # each char at once
    parts = [p for d in seen for p in d.get("tool_calls", [])]
    header, fragments = parts[0], parts[1:]
    assert header["id"].startswith("call_") and header["type"] == "function"
    assert header["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(f) == {"index", "function"} and f["index"] == 0 for f in fragments)
    assert len(fragments) == len(WEATHER)  # one fragment per character: streamed as it came
    assert "".join(f["function"]["arguments"] for f in fragments) == WEATHER


def test_a_call_cut_by_max_tokens_keeps_what_came_and_finishes_length() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"x": [1, 2'
    deltas, finish = run(PARSERS["hermes"](), list(text), reason="length")
    assert finish == "length"
    assert calls_of(fold(deltas)) == [("f", '{"x": [1, 2')]


def test_forced_named_and_required() -> None:
    deltas, finish = run(Forced("get_weather"), list(" " + WEATHER))
    assert calls_of(fold(deltas)) == [("get_weather", WEATHER)]
    assert fold(deltas)["content"] is None and finish == "tool_calls"
    text = (
        f'[{{"name": "get_weather", "parameters": {WEATHER}}}, {{"name": "t", "parameters": {{}}}}]'
    )
    deltas, _ = run(Forced(), splits(text)[2])
    assert calls_of(fold(deltas)) == [("get_weather", WEATHER), ("t", "{}")]
    deltas, finish = run(Forced("f"), ["oops"])  # a grammar would not let this through
    assert fold(deltas) == {"role": "assistant", "content": "oops"} and finish == "stop"


def test_detect_from_template_text() -> None:
    assert detect("... <tool_call>\\n{...}</tool_call> ...") == "hermes"
    assert detect("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect("<|start_header_id|>ipython ... <|python_tag|>") == "llama3_json"
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_jsonscan() -> None:
    assert value_end('"a\\"b" x', 0) == 6
    assert value_end('{"a": [1, "]"]} x', 0) == 15
    assert value_end("12", 0) is None and value_end("12,", 0) == 2
    assert value_end("tru", 0) is None and value_end("true}", 0) == 4
    for bad in ("x", "01,", "nul,"):
        with pytest.raises(Malformed):
            value_end(bad, 0)
    scan = scan_object('{"name": "f", "arguments": {"a": 1', 0)
    assert scan.string('{"name": "f", "arguments": {"a": 1', "name") == "f"
    assert scan.fields["arguments"][1] is None and scan.end is None
    with pytest.raises(Malformed):
        scan_object('{"a" 1}', 0)


def test_without_parallel_calls_only_the_first_call_counts() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    for pieces in splits(text):
        asm = ToolAssembler(PARSERS["hermes"](), max_calls=1)
        deltas = [d for p in pieces for d in asm.feed(p)]
        last, finish = asm.finish("stop")
        assert calls_of(fold(deltas + last)) == [("a", "{}")] and finish == "tool_calls"


def test_json_that_is_not_a_call_is_released_at_its_first_value() -> None:
    asm = ToolAssembler(PARSERS["llama3_json"]())
    assert asm.feed('{"answer": ') == []  # may still be a call
    assert asm.feed("4") == [{"content": '{"answer": 4'}]  # not one: text from here on
    assert asm.feed("2}") == [{"content": "2}"}]
    assert asm.finish("stop") == ([], "stop")


def test_mistral_v11_streams_a_named_call_once_its_name_ends() -> None:
    asm = ToolAssembler(MistralV11())
    assert asm.feed("[TOOL_CALLS]get_we") == []
    assert asm.feed("ather[AR") == []  # the name may still go on until [ARGS] is whole
    (header,) = asm.feed("GS]")[0]["tool_calls"]
    assert header["function"] == {"name": "get_weather", "arguments": ""}
    assert asm.feed('{"city": "Pa') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}
    ]
    assert asm.feed('ris"}')[0]["tool_calls"][0]["function"]["arguments"] == 'ris"}'
    last, finish = asm.finish("stop")
    assert last == [] and finish == "tool_calls"


def test_which_mistral_form_a_checkpoint_writes() -> None:
    """v11 on where the tokenizer has an [ARGS] token or the template writes [ARGS]."""
    v11_template = "{{ '[TOOL_CALLS]' + call.function.name + '[ARGS]' + args }}"
    old_template = "{{ '[TOOL_CALLS]' + calls|tojson }}"
    has_args = {"[ARGS]"}.__contains__
    assert parser_for("mistral", has_args, old_template) is MistralV11
    assert parser_for("mistral", set().__contains__, v11_template) is MistralV11
    assert parser_for("mistral", set().__contains__, old_template) is Mistral
    assert parser_for("hermes", has_args, v11_template) is PARSERS["hermes"]
