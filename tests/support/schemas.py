"""JSON schemas for the structured-output tests (issue 42): nested objects, arrays, enums, numbers
with bounds, required and optional fields, strings with patterns. Strings, arrays and numbers are
bounded (a number's decimals too: `multipleOf`) so that any answer the grammar allows ends well
within the tests' max_tokens, whatever logits a device computes."""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


_NAME = {"type": "string", "maxLength": 12}


def _money(top: int) -> dict[str, Any]:
    """A number in [0, top] of at most two decimals: a JSON number's fraction (and exponent)
    is unbounded otherwise, and a random model may write digits until max_tokens."""
    return {"type": "number", "minimum": 0, "maximum": top, "multipleOf": 0.01}


_AGE = {"type": "integer", "minimum": 0, "maximum": 120}

SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": _NAME}),
    _obj({"name": _NAME, "age": _AGE}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"colour": {"enum": ["red", "green", "blue"]}}),
    _obj(
        {
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
        }
    ),
    _obj({"score": _money(1)}),
    _obj({"temp": {"type": "integer", "minimum": -40, "maximum": 50}}),
    _obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}),
    _obj(
        {
            "nums": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 4,
            }
        }
    ),
    _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    _obj({"city": _NAME, "country": {"type": "string", "maxLength": 12}}, required=["city"]),
    _obj(
        {"title": _NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
        required=["title"],
    ),
    _obj({"person": _obj({"name": _NAME, "age": _AGE})}),
    _obj({"a": _obj({"b": _obj({"c": {"type": "integer", "minimum": 0, "maximum": 9}})})}),
    _obj({"people": {"type": "array", "items": _obj({"name": _NAME}), "maxItems": 2}}),
    _obj(
        {
            "point": _obj(
                {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                }
            )
        }
    ),
    _obj(
        {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string", "maxLength": 16}},
        required=["answer"],
    ),
    _obj(
        {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "active": {"type": "boolean"},
            "role": {"enum": ["admin", "user"]},
        }
    ),
    _obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    _obj(
        {
            "price": _money(100),
            "currency": {"enum": ["EUR", "USD"]},
        }
    ),
    _obj(
        {
            "matrix": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "maxItems": 2,
                },
                "maxItems": 2,
            }
        }
    ),
    _obj(
        {
            "event": _obj(
                {
                    "day": {"type": "integer", "minimum": 1, "maximum": 31},
                    "month": {"enum": ["jan", "feb", "mar"]},
                },
                required=["day"],
            ),
            "note": _NAME,
        },
        required=["event"],
    ),
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 3,
    },
]
