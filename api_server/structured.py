"""Structured output at the API (issue 42): what a request asks for, as the daemons' contract
(`SamplingParams.structured`), and its grammar compiled here first, so a spec that does not
compile is a 400 naming the problem before any daemon sees the request.

Accepted: `response_format` `{"type": "text"}` (nothing), `{"type": "json_object"}`,
`{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}` (strict
or not, the schema is enforced); vLLM's extra fields `guided_json` (a schema, object or text),
`guided_regex`, `guided_choice` (a list of strings), `guided_grammar` (Lark, or GBNF). At most
one of them per request. The daemons enforce it on every token; the API's compile is a check
(and what /metrics times), cached per model like theirs.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from api_server.errors import ApiError, bad_field
from common.model.config import BYTE_VOCAB, TINY_EOS
from common.model.tokenizer import ByteTokenizer, HFTokenizer
from common.sampling_params import MAX_STRUCTURED_SPEC, StructuredOutput
from common.structured import GrammarCache, GrammarError, grammars_for

#: vLLM's extra fields and the kind each one asks for
GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_FORMATS = ("text", "json_object", "json_schema")


def structured_of(req: Any) -> StructuredOutput | None:
    """The constraint `req` asks for (None: free text); ApiError 400 naming the field when its
    response_format or guided_* field is malformed, or when it asks for two."""
    asked: list[tuple[str, StructuredOutput]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        found = _response_format(fmt)
        if found is not None:
            asked.append(("response_format", found))
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            asked.append((name, StructuredOutput(kind, _guided_spec(name, kind, value))))
    if len(asked) > 1:
        names = " and ".join(name for name, _ in asked)
        raise bad_field(asked[1][0], f"{names} each constrain the output: give one of them")
    if not asked:
        return None
    name, found = asked[0]
    if len(found.spec) > MAX_STRUCTURED_SPEC:
        raise bad_field(name, f"{name} is longer than {MAX_STRUCTURED_SPEC} characters")
    return found


def _response_format(fmt: Any) -> StructuredOutput | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in _FORMATS:
        raise bad_field(
            "response_format.type",
            f"response_format.type must be one of {', '.join(_FORMATS)}, got {kind!r}",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    body = fmt.get("json_schema")
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise bad_field(
            "response_format.json_schema",
            'response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
        )
    schema = body.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_field("response_format.json_schema.schema", "the schema must be a JSON object")
    return StructuredOutput("json_schema", json.dumps(schema))


def _guided_spec(name: str, kind: str, value: Any) -> str:
    if kind == "json_schema" and isinstance(value, dict):
        return json.dumps(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise bad_field(name, f"{name} must be a non-empty list of strings")
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        raise bad_field(name, f"{name} must be a non-empty string")
    return value


_caches: dict[str, GrammarCache] = {}


def _cache_for(path: str) -> GrammarCache:
    """The API's grammar cache for the daemons' tokenizer (`path`: their checkpoint directory,
    "" for the tiny model; built once per model, ~0.5 s for a 49k vocabulary)."""
    cache = _caches.get(path)
    model_dir = Path(path) if path else None
    if cache is None:
        if model_dir is None or not (model_dir / "tokenizer.json").is_file():
            cache = grammars_for(ByteTokenizer(), BYTE_VOCAB + 4, {TINY_EOS})
        else:
            tok = HFTokenizer(model_dir / "tokenizer.json", bos_token_id=None, eos_token_id=None)
            eos = {tok.eos_token_id if tok.eos_token_id is not None else 0}
            cache = grammars_for(tok, tok.vocab_size, eos)
        _caches[path] = cache
    return cache


def source_field(req: Any) -> str:
    """The request field that set its constraint (what a refusal names)."""
    for name in GUIDED:
        if getattr(req, name, None) is not None:
            return name
    return "response_format"


async def check(
    structured: StructuredOutput, model_dir: str, metrics: Any, param: str = "response_format"
) -> None:
    """Compile `structured` for the served model (off the event loop); ApiError 400 naming
    `param` and the problem when it does not. Counts the request and times a compile in
    `metrics`."""
    metrics.structured.labels(structured.kind).inc()

    def compile_it() -> float:
        cache = _cache_for(model_dir)
        before = cache.compiles
        started = time.perf_counter()
        cache.compile(structured)
        return time.perf_counter() - started if cache.compiles > before else -1.0

    try:
        seconds = await asyncio.to_thread(compile_it)
    except GrammarError as exc:
        raise ApiError(400, str(exc), param=param, code="invalid_structured_output") from None
    if seconds >= 0:
        metrics.grammar_compile.observe(seconds)


__all__ = ["GUIDED", "check", "source_field", "structured_of"]
