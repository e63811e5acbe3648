"""Version history, the message-type table and the handshake fingerprint."""

from __future__ import annotations

import re

import pytest

from common.protocol import HISTORY, PROTOCOL_VERSION, MsgType, fingerprint
from common.protocol.version import MAGIC, SUPPORTED_VERSIONS
from tests.support.protocol_strategies import ROOT

DOC = (ROOT / "docs" / "protocol.md").read_text()
LAYOUT = {
    "num_blocks": 1024,
    "num_layers": 2,
    "block_size": 16,
    "num_kv_heads": 2,
    "head_dim": 16,
    "dtype": "float32",
}


def _fp(**changes: object) -> str:
    model = changes.pop("model", "tiny-llama")
    backend = changes.pop("backend", "shm")
    return fingerprint(model_id=str(model), layout={**LAYOUT, **changes}, backend=str(backend))


def test_history_is_numbered_from_one_and_ends_at_the_current_version() -> None:
    assert list(HISTORY) == list(range(1, PROTOCOL_VERSION + 1))
    assert all(text.strip() for text in HISTORY.values())
    assert PROTOCOL_VERSION in SUPPORTED_VERSIONS
    assert max(SUPPORTED_VERSIONS) == PROTOCOL_VERSION
    assert MAGIC == b"PDKV"


def test_doc_lists_every_version_of_the_history() -> None:
    for version, text in HISTORY.items():
        assert re.search(rf"^\| {version}\s+\| {re.escape(text)}\s*\|$", DOC, re.M), (
            f"docs/protocol.md lacks version {version} of HISTORY"
        )


def test_doc_gives_the_header_version_of_today() -> None:
    assert f"protocol version of the sender (today {PROTOCOL_VERSION})" in DOC


def test_doc_lists_every_message_type_with_its_number() -> None:
    for t in MsgType:
        assert re.search(rf"^\| {int(t)}\s+\| {t.name}\s+\|", DOC, re.M), (
            f"{t.name} not in the table"
        )


def test_fingerprint_is_stable_and_16_hex_digits() -> None:
    fp = _fp()
    assert re.fullmatch(r"[0-9a-f]{16}", fp)
    assert fp == _fp()
    # Pinned: a change of the canonical form must be deliberate (and bump the protocol version).
    assert fp == "36f33879bca4ffec"


def test_fingerprint_ignores_key_order_and_num_blocks() -> None:
    reordered = dict(reversed(list(LAYOUT.items())))
    assert fingerprint(model_id="tiny-llama", layout=reordered, backend="shm") == _fp()
    assert _fp(num_blocks=7) == _fp(num_blocks=100_000) == _fp()
    without = {k: v for k, v in LAYOUT.items() if k != "num_blocks"}
    assert fingerprint(model_id="tiny-llama", layout=without, backend="shm") == _fp()


@pytest.mark.parametrize(
    "change",
    [
        {"model": "llama-3-8b"},
        {"dtype": "bfloat16"},
        {"block_size": 32},
        {"num_kv_heads": 4},
        {"head_dim": 64},
        {"num_layers": 3},
        {"backend": "cuda-raw"},
        {"kv_layout": "block-major"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_fingerprint_changes_with_what_shapes_a_block(change: dict[str, object]) -> None:
    assert _fp(**change) != _fp()
