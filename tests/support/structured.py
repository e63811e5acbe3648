"""What the structured-output tests (issue 42) say when an answer is wrong: every failing answer
with its index, finish reason, token count and text, and the daemons' errors and warnings, so
that a run whose output is cut short (a GPU run) still names what failed and where."""

from __future__ import annotations

import json
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import jsonschema
import pytest
import torch

from common import client
from common.model.llama import LlamaModel
from common.model.paged import blocks_for, slots_for
from common.model.sampling import SamplingParams, draw, finish_reason, make_generator
from common.structured import bitmask, grammars_for
from tests.support.daemons import Pair

#: characters of an answer's text, and of one log line, a message quotes
TEXT_CHARS = 160
#: error and warning lines of each daemon's log a message quotes (the last ones)
LOG_LINES = 12


#: the structured CUDA tests run once with the daemons' CUDA defaults and once without each
#: CUDA-only feature the decode or the prefill could get wrong under a grammar: (decode args,
#: prefill args, both daemons' extra environment). A failure under some and not others names
#: the feature (issue 42's H200 run failed, its log cut). PDKV_KERNELS=0: the torch path on the
#: GPU, so no Triton kernel and no CUDA graph in either daemon.
CUDA_VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]] = {
    "defaults": ((), (), {}),
    "no-overlapped-steps": (("--overlap-steps", "off"), (), {}),
    "no-prefill-graphs": ((), ("--prefill-graph-tokens", "0"), {}),
    "no-kv-launched": ((), ("--no-launch-early",), {}),
    "no-early-handoff": ((), ("--no-early-handoff",), {}),
    "no-kernels-no-graphs": ((), (), {"PDKV_KERNELS": "0"}),
}


def require_grammar_library() -> None:
    """Fail at once, saying so, where llguidance cannot be imported (the GPU machine installs it
    from bench/device_wheels.sh's wheels): every constrained request would fail INTERNAL."""
    try:
        import llguidance  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"llguidance is not importable ({exc}): run bench/device_wheels.sh first")


def describe(res: client.Result | BaseException) -> str:
    """One answer in a line: its finish reason, token count and (the start of) its text."""
    if isinstance(res, BaseException):
        return f"raised {type(res).__name__}: {res}"
    reason = None if res.finish is None else res.finish.reason
    return f"finish={reason} tokens={len(res.tokens)} text={res.text[:TEXT_CHARS]!r}"


def validate_json(text: str, schema: dict[str, Any]) -> None:
    """`jsonschema.validate` of the JSON `text` against `schema`, the numbers of both read as
    Decimal so that `multipleOf` is exact: jsonschema divides floats, and 0.07 / 0.01 is not 7 to
    it (nor are 1,363 of the 10,001 two-decimal numbers in [0, 100] multiples of 0.01), where
    the grammar allows every one of them. ValueError when `text` is not JSON."""
    exact = json.loads(json.dumps(schema), parse_float=Decimal)
    jsonschema.validate(json.loads(text, parse_float=Decimal), exact)


def invalid(res: client.Result | BaseException, schema: dict[str, Any]) -> str | None:
    """Why `res` is not a finished ("stop") answer that parses and validates; None when it is."""
    if isinstance(res, BaseException):
        return "failed"
    if res.finish is None or res.finish.reason != "stop":
        return "did not stop"
    try:
        validate_json(res.text, schema)
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"invalid ({str(exc).splitlines()[0][:TEXT_CHARS]})"
    return None


def daemon_trouble(pair: Pair | None) -> str:
    """The last error and warning lines of each daemon's JSON log (empty when none)."""
    if pair is None:
        return ""
    out = []
    for role, daemon in pair.daemons.items():
        lines = []
        for line in daemon.log_text().splitlines():
            try:
                level = json.loads(line).get("level")
            except ValueError:
                level = "error" if "Traceback" in line or "Error" in line else None
            if level in ("error", "warning", "critical"):
                lines.append(f"  {role}: {line[: 2 * TEXT_CHARS]}")
        out.extend(lines[-LOG_LINES:])
    return "\n".join(["daemons' errors and warnings:", *out]) if out else ""


def assert_valid(
    results: Sequence[client.Result | BaseException],
    schemas: Sequence[dict[str, Any]],
    pair: Pair | None = None,
    what: str = "answers",
) -> None:
    """Every result finished "stop" and validates against its schema; else one message naming
    each failing answer (index, why, finish, tokens, text) and the daemons' trouble."""
    bad = [
        f"  #{i} {why}: {describe(res)}"
        for i, (res, schema) in enumerate(zip(results, schemas, strict=True))
        if (why := invalid(res, schema)) is not None
    ]
    if bad:
        lengths = [len(r.tokens) for r in results if isinstance(r, client.Result)]
        head = f"{what}: {len(bad)} of {len(results)} wrong (most tokens {max(lengths, default=0)})"
        pytest.fail("\n".join([head, *bad[:40], daemon_trouble(pair)]), pytrace=False)


def first_difference(got: Sequence[int], want: Sequence[int]) -> str:
    """Where two token lists part: the index and each one's token there (or its end)."""
    k = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if k is None:
        k = min(len(got), len(want))
    at = lambda xs: xs[k] if k < len(xs) else "end"  # noqa: E731
    return f"first differ at {k}: got {at(got)}, want {at(want)} (lengths {len(got)}, {len(want)})"


def constrained_generate(
    model: LlamaModel,
    tokenizer: Any,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    block_size: int,
) -> list[int]:
    """The single-process answer of `prompt` under `params.structured` (a batch of one, eager):
    every token, the first included, drawn as `draw` draws it under the matcher's mask (with the
    generator of (seed, step)), ending where the daemons end a constrained sequence: the grammar
    refused the token or its text is complete ("stop"), else `finish_reason`."""
    assert params.structured is not None
    params = params.validate().with_seed()
    stops = model.config.stop_token_ids
    grammars = grammars_for(tokenizer, model.config.vocab_size, stops)
    matcher = grammars.compile(params.structured).matcher()
    width = blocks_for(len(prompt) + params.max_tokens, block_size)
    kv = model.new_kv_cache(width, block_size)
    table = torch.arange(width)
    slots = slots_for(table, 0, len(prompt), block_size)
    logits = model.prefill(torch.tensor(list(prompt)), slots, kv)[None]
    mask = bitmask.allocate(1, logits.shape[-1])
    out: list[int] = []
    while True:
        mask.zero_()
        matcher.fill(mask, 0)
        step = len(out)
        gen = make_generator(params, step)
        tokens, _ = draw(
            logits,
            [params],
            [gen],
            steps=[step],
            histories=[None],
            eos_ids=stops,
            masks=([0], mask),
        )
        token = tokens[0]
        assert isinstance(token, int), token
        out.append(token)
        if not matcher.accept(token) or matcher.terminated or finish_reason(out, params, stops):
            return out
        pos = len(prompt) + step
        logits = model.decode_step(
            torch.tensor([token]),
            torch.tensor([pos]),
            slots_for(table, pos, 1, block_size),
            table[None, : pos // block_size + 1],
            torch.tensor([pos + 1]),
            kv,
        )


__all__ = [
    "CUDA_VARIANTS",
    "assert_valid",
    "constrained_generate",
    "daemon_trouble",
    "describe",
    "first_difference",
    "invalid",
    "require_grammar_library",
    "validate_json",
]
