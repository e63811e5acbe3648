"""The tests' schema check (tests.support.structured.validate_json) agrees with the grammar on
`multipleOf`: every two-decimal price the money schema's grammar accepts validates, a third
decimal is refused by both. Plain `jsonschema.validate` divides floats and calls 0.07 no
multiple of 0.01: an answer the grammar rightly allowed would fail a structured test."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common.model.tokenizer import ByteTokenizer
from common.sampling_params import StructuredOutput
from common.structured import grammars_for
from tests.support.schemas import SCHEMAS
from tests.support.structured import validate_json

MONEY = next(s for s in SCHEMAS if "multipleOf" in json.dumps(s) and "price" in s["properties"])


def _grammar_accepts(text: str) -> bool:
    compiled = grammars_for(ByteTokenizer(), 260, {257}).compile(
        StructuredOutput("json_schema", json.dumps(MONEY))
    )
    m = compiled.matcher()
    return all(m.accept(b) for b in text.encode()) and m.terminated


def _valid(text: str) -> bool:
    try:
        validate_json(text, MONEY)
    except jsonschema.ValidationError:
        return False
    return True


@pytest.mark.parametrize("price", ["0.07", "0.29", "19.99", "1.1", "100", "0.5"])
def test_a_two_decimal_price_the_grammar_allows_validates(price: str) -> None:
    text = f'{{"price": {price}, "currency": "EUR"}}'
    assert _grammar_accepts(text) and _valid(text)


@pytest.mark.parametrize("price", ["0.071", "100.01"])
def test_a_price_the_grammar_refuses_does_not_validate(price: str) -> None:
    text = f'{{"price": {price}, "currency": "EUR"}}'
    assert not _grammar_accepts(text) and not _valid(text)


def test_plain_jsonschema_would_refuse_a_price_the_grammar_allows() -> None:
    """Why validate_json reads Decimals (if jsonschema changes this, the helper may go)."""
    with pytest.raises(jsonschema.ValidationError, match=r"multiple of 0\.01"):
        jsonschema.validate(json.loads('{"price": 0.07, "currency": "EUR"}'), MONEY)
