"""The test vectors of docs/protocol.md decode to their examples, and the examples encode to them."""

from __future__ import annotations

import re

import pytest

from common.protocol import Message, MsgType, decode, encode
from tests.support.protocol_strategies import vector_script

gen = vector_script()
DOC = gen.DOC.read_text()
VECTOR = re.compile(r"<!-- vector (\w+) -->\n```text\n([0-9a-f\n]+)```")
EXAMPLES = {m.TYPE.name: m for m in gen.examples()}


def _vectors() -> dict[str, bytes]:
    found = VECTOR.findall(DOC)
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"a message type has two vectors: {names}"
    return {name: bytes.fromhex(hexstr.replace("\n", "")) for name, hexstr in found}


def test_one_vector_and_one_example_per_message_type() -> None:
    every = {t.name for t in MsgType}
    assert set(_vectors()) == every
    assert set(EXAMPLES) == every


@pytest.mark.parametrize("name", [t.name for t in MsgType])
def test_vector_decodes_to_its_example_and_back(name: str) -> None:
    frame = _vectors()[name]
    example: Message = EXAMPLES[name]
    assert decode(frame) == example
    assert encode(example).hex() == frame.hex()


def test_generated_section_is_current() -> None:
    """Headings, sizes and JSON shown beside each vector are the generator's output, verbatim."""
    assert gen.BEGIN in DOC and gen.END in DOC
    assert gen.splice(DOC, gen.render()) == DOC, (
        "run: python scripts/gen_protocol_vectors.py --write"
    )
    assert gen.main(["--check"]) == 0


def test_register_vector_has_both_binary_segments() -> None:
    frame = _vectors()["REGISTER"]
    mem_len, ev_len = int.from_bytes(frame[12:16], "big"), int.from_bytes(frame[16:20], "big")
    assert (mem_len, ev_len) == (64, 128)
    assert frame.endswith(bytes(range(64)) + b"\xe0" * 64 + b"\xe1" * 64)
