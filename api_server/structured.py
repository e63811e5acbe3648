"""Structured output at the API (issue 42): what a request asks for, as the daemons' contract
(`SamplingParams.structured`), and its grammar compiled here first, so a spec that does not
compile is a 400 naming the problem before any daemon sees the request.

Accepted: `response_format` `{"type": "text"}` (nothing), `{"type": "json_object"}`,
`{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}` (strict
or not, the schema is enforced); vLLM's object `structured_outputs` (vLLM >= 0.10: one of
`json`, `regex`, `choice`, `grammar`, `json_object`, with the options in OUTPUT_OPTIONS) and its
older extra fields `guided_json` (a schema, object or text), `guided_regex`, `guided_choice` (a
list of strings), `guided_grammar` (Lark, or GBNF). At most one constraint per request, across
all of them. The daemons enforce it on every token; the API's compile is a check (and what
/metrics times), cached per model like theirs.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

from api_server.errors import ApiError, bad_field, unsupported
from common.model.config import BYTE_VOCAB, TINY_EOS
from common.model.tokenizer import ByteTokenizer, HFTokenizer
from common.sampling_params import MAX_STRUCTURED_SPEC, StructuredOutput
from common.structured import GrammarCache, GrammarError, grammars_for
from common.structured.warm import warm_in_background

#: vLLM's extra fields and the kind each one asks for
GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_FORMATS = ("text", "json_object", "json_schema")
#: vLLM's `structured_outputs` object: its constraint keys and the kind each one asks for
OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
#: its options, and what pdkv does with them: JSON is always laid out compactly (as with
#: disable_any_whitespace), one grammar library serves every request (nothing to fall back
#: to), and disable_additional_properties closes every object that does not say otherwise
OUTPUT_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")
#: its keys that ask for what pdkv does not do
_OUTPUTS_REFUSED = {
    "structural_tag": "structural tags are not supported by pdkv",
    "whitespace_pattern": "pdkv lays JSON out compactly; a whitespace pattern is not supported",
}


def structured_of(req: Any) -> StructuredOutput | None:
    """The constraint `req` asks for (None: free text); ApiError 400 naming the field when its
    response_format, structured_outputs or guided_* field is malformed, or when it asks for
    two."""
    asked = _asked(req)
    if len(asked) > 1:
        names = " and ".join(name for name, _ in asked)
        raise bad_field(asked[1][0], f"{names} each constrain the output: give one of them")
    if not asked:
        return None
    name, found = asked[0]
    if len(found.spec) > MAX_STRUCTURED_SPEC:
        raise bad_field(name, f"{name} is longer than {MAX_STRUCTURED_SPEC} characters")
    return found


def _asked(req: Any) -> list[tuple[str, StructuredOutput]]:
    """Every (field, constraint) `req` asks for, in a fixed order."""
    asked: list[tuple[str, StructuredOutput]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        found = _response_format(fmt)
        if found is not None:
            asked.append(("response_format", found))
    outputs = getattr(req, "structured_outputs", None)
    if outputs is not None:
        asked += _structured_outputs(outputs)
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            asked.append((name, StructuredOutput(kind, _guided_spec(name, kind, value))))
    return asked


def _structured_outputs(outputs: dict[str, Any]) -> list[tuple[str, StructuredOutput]]:
    """The constraints of vLLM's `structured_outputs` object, each with the field that set
    it (`structured_outputs.json`, ...); 400 for a key pdkv does not know or does not do, and
    for an option that is not a boolean."""
    for key, value in outputs.items():
        param = f"structured_outputs.{key}"
        if key in _OUTPUTS_REFUSED and value is not None:
            raise unsupported(param, _OUTPUTS_REFUSED[key])
        if key in OUTPUT_OPTIONS and not isinstance(value, bool | None):
            raise bad_field(param, f"{param} must be a boolean")
        if key not in OUTPUTS and key not in OUTPUT_OPTIONS and key not in _OUTPUTS_REFUSED:
            known = ", ".join([*OUTPUTS, *OUTPUT_OPTIONS])
            raise bad_field(param, f"structured_outputs has no field {key!r}: it takes {known}")
    found = []
    for key, kind in OUTPUTS.items():
        value, param = outputs.get(key), f"structured_outputs.{key}"
        if value is None or (value is False and kind == "json_object"):
            continue
        if kind == "json_object":
            if value is not True:
                raise bad_field(param, f"{param} must be a boolean")
            found.append((param, StructuredOutput("json_object")))
            continue
        spec = _guided_spec(param, kind, value)
        if kind == "json_schema" and outputs.get("disable_additional_properties"):
            spec = _closed_spec(spec)
        found.append((param, StructuredOutput(kind, spec)))
    return found


def _closed_spec(spec: str) -> str:
    try:
        schema = json.loads(spec)
    except ValueError:
        return spec  # not JSON: the compile names the problem
    return json.dumps(_closed(schema))


#: where a JSON schema holds schemas: one, a list of them, a mapping of names to them
_ONE = ("items", "not", "if", "then", "else", "additionalProperties", "contains")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _closed(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` in every object schema that has
    `properties` and does not say (vLLM's disable_additional_properties)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = _closed(out[key])
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out


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
_caches_lock = threading.Lock()


def warm(path: str) -> threading.Thread:
    """Build the grammar cache of the daemons' model (`path` as in `_cache_for`) on a thread of
    its own, when the API learns the model: the first constrained request then costs a
    schema's compile, not the ~0.5 s of the tokenizer's view (common.structured.warm)."""
    return warm_in_background(lambda: _cache_for(path), role="api", path=path or None)


def _cache_for(path: str) -> GrammarCache:
    """The API's grammar cache for the daemons' tokenizer (`path`: their checkpoint directory,
    "" for the tiny model; built once per model, ~0.5 s for a 49k vocabulary)."""
    with _caches_lock:  # the warm thread and a request's compile build it once between them
        return _cache_locked(path)


def _cache_locked(path: str) -> GrammarCache:
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
    """The request field that set its constraint (what a refusal names): response_format
    when a tool_choice forced it."""
    asked = _asked(req)
    return asked[0][0] if asked else "response_format"


async def check(
    structured: StructuredOutput, model_dir: str, metrics: Any, param: str = "response_format"
) -> None:
    """Compile `structured` for the served model (off the event loop); ApiError 400 naming
    `param` and the problem when it does not. Counts the request and times a compile in
    `metrics`."""
    metrics.structured.labels(structured.kind).inc()
    cache = _caches.get(model_dir)  # built (else the thread builds it, or waits for the warm)
    if cache is not None and cache.cached(structured) is not None:
        return  # compiled before: found on the loop, no thread hop

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


__all__ = ["GUIDED", "OUTPUTS", "OUTPUT_OPTIONS", "check", "source_field", "structured_of"]
