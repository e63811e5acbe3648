"""What pdkv's view of a tokenizer costs (issue 42: added tokens that are not special are text,
a special token's name in a grammar's text is its bytes; common.structured.grammar._from_json,
which reads the tokenizer with llguidance and hands the bytes back to it): the time to build it
for SmolLM2's tokenizer.json, against llguidance's own reading (LLTokenizer(json)), as it is and
with some of its added tokens made not special, and the mean mask step of JSON schemas' answers
under each.

    .venv/bin/python bench/grammar_added_tokens.py [--smollm2 DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llguidance

from common.structured import bitmask
from common.structured.grammar import JSON_LAYOUT, _from_json
from tests.support.schemas import SCHEMAS
from tests.support.smollm2 import smollm2_dir


def own(text: str, vocab: int, eos: list[int]) -> object:
    return llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos)


def build_s(build, text: str, vocab: int, eos: int, repeats: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    times, tok = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        tok = build(text, vocab, [eos])
        times.append(time.perf_counter() - started)
    return statistics.median(times), tok


def mask_us(tok: object, vocab: int, steps: int = 200) -> float:
    """Mean microseconds of a mask over the answers of the first schemas, each token drawn as
    the middle one the mask allows (a valid answer, whatever the tokenizer)."""
    mask, spent, n = bitmask.allocate(1, vocab), 0.0, 0
    for schema in SCHEMAS[:6]:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=JSON_LAYOUT
        )
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        while not m.is_stopped() and n < steps:
            mask.zero_()
            started = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask[0].data_ptr(), mask[0].numel() * 4)
            spent += time.perf_counter() - started
            ok = bitmask.allowed(mask, vocab)[0].nonzero().flatten()
            assert m.consume_token(int(ok[len(ok) // 2])), m.get_error()
            n += 1
    return spent / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smollm2", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    path = (args.smollm2 or smollm2_dir()) / "tokenizer.json"
    text = path.read_text()
    config = json.loads((path.parent / "config.json").read_text())
    vocab, eos = config["vocab_size"], config["eos_token_id"]
    spec = json.loads(text)
    plain = [t for t in spec["added_tokens"] if t["id"] != eos][:8]
    for t in plain:
        t["special"] = False
    pdkv = lambda t, v, e: _from_json(llguidance, t, v, e)  # noqa: E731
    for name, build, variant in (
        ("llguidance's own", own, text),
        ("pdkv's", pdkv, text),
        (f"pdkv's, {len(plain)} not special", pdkv, json.dumps(spec)),
    ):
        seconds, tok = build_s(build, variant, vocab, eos, args.repeats)
        print(f"{name:>26}: build {seconds * 1e3:.0f} ms, mask {mask_us(tok, vocab):.0f} us")


if __name__ == "__main__":
    main()
