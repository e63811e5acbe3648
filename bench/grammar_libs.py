"""llguidance vs xgrammar on this host (issue 42 item 1): compile time of a JSON schema and the
per-token mask time at batch 1 and 64, with the tiny model's byte tokenizer and SmolLM2's.

    .venv/bin/python bench/grammar_libs.py [--smollm2 DIR] [--steps 200]

xgrammar is not a dependency (it brings triton and apache-tvm-ffi): `pip install xgrammar` into
the venv to compare, then uninstall it; without it only llguidance is measured.

Each sequence follows the same valid answer (tokenized by the tokenizer); a step fills the mask
of every sequence of the batch (one after the other on this thread, as the engine does) and then
advances each by its next token. Compile: a fresh compile of a schema never seen (median of
several distinct schemas), from text to a matcher ready for its first mask.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "tags": ["a", "ccc"], "address": {"city": "London", "zip": "12345"}}'


def schemas(n: int) -> list[str]:
    """n distinct schemas (a property name differs), so no compile hits a cache."""
    out = []
    for i in range(n):
        s = json.loads(json.dumps(SCHEMA))
        s["properties"][f"extra{i}"] = {"type": "number", "minimum": -i, "maximum": i + 1}
        out.append(json.dumps(s))
    return out


class Llg:
    name = "llguidance"

    def __init__(self, tok_json: str | None, byte_vocab: bool) -> None:
        import llguidance
        import llguidance.torch as lt

        self.llg, self.lt = llguidance, lt
        if byte_vocab:
            self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
        else:
            self.tok = llguidance.LLTokenizer(tok_json)

    def compile(self, schema: str):
        m = self.llg.LLMatcher(self.tok, self.llg.grammar_from("json_schema", schema))
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def bitmask(self, n: int) -> torch.Tensor:
        return self.lt.allocate_token_bitmask(n, self.tok.vocab_size)

    def fill(self, m, mask: torch.Tensor, row: int) -> None:
        self.lt.fill_next_token_bitmask(m, mask, row)

    def accept(self, m, t: int) -> None:
        assert m.consume_token(t), m.get_error()

    def fill_all(self, ms: list, mask: torch.Tensor) -> None:
        """The batch's masks in llguidance's own threads (the GIL released)."""
        if not hasattr(self, "executor"):
            self.executor = self.llg.LLExecutor()
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], mask)


class Xgr:
    name = "xgrammar"

    def __init__(self, tok_json_dir: str | None, byte_vocab: bool) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        if byte_vocab:
            vocab = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>", b"<pad>", b"<unk>"]
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[257])
        else:
            from transformers import AutoTokenizer

            info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tok_json_dir))
        self.info = info
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: str):
        compiled = self.compiler.compile_json_schema(schema)
        self.xgr.GrammarMatcher(compiled)  # ready for a first mask, as llguidance's is
        return compiled

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.info.vocab_size)

    def fill(self, m, mask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(mask, row)

    def accept(self, m, t: int) -> None:
        assert m.accept_token(t)


class _Bytes:
    """The tiny model's byte tokenizer as llguidance's TokenizerWrapper wants it."""

    eos_token_id, bos_token_id = 257, 256
    tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>", b"<pad>", b"<unk>"]
    special_token_ids = [256, 257, 258, 259]

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


def run(lib, answer_ids: list[int], steps: int) -> dict[str, float]:
    compiles = []
    for s in schemas(6):
        t0 = time.perf_counter()
        compiled = lib.compile(s)
        compiles.append(time.perf_counter() - t0)
    out = {
        "compile_ms_median": 1e3 * statistics.median(compiles),
        "compile_ms_max": 1e3 * max(compiles),
    }
    compiled = lib.compile(json.dumps(SCHEMA))
    ids = answer_ids[:steps]
    runs = [(1, False), (64, False)] + ([(64, True)] if hasattr(lib, "fill_all") else [])
    for batch, par in runs:
        ms = [lib.matcher(compiled) for _ in range(batch)]
        mask = lib.bitmask(batch)
        per_step = []
        for t in ids:
            t0 = time.perf_counter()
            if par:
                lib.fill_all(ms, mask)
            else:
                for row, m in enumerate(ms):
                    lib.fill(m, mask, row)
            per_step.append(time.perf_counter() - t0)
            for m in ms:
                lib.accept(m, t)
        per_step.sort()
        tag = f"b{batch}{'par' if par else ''}"
        out[f"{tag}_step_ms_mean"] = 1e3 * statistics.fmean(per_step)
        out[f"{tag}_step_ms_p99"] = (
            1e3 * per_step[min(len(per_step) - 1, int(0.99 * len(per_step)))]
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--smollm2", default=str(Path.home() / ".cache/pdkv/models/smollm2-135m-instruct")
    )
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tok_path = Path(args.smollm2) / "tokenizer.json"
    smol_ids = Tokenizer.from_file(str(tok_path)).encode(ANSWER, add_special_tokens=False).ids
    cases = [
        ("tiny (bytes, vocab 260)", None, True, list(ANSWER.encode())),
        ("SmolLM2 (vocab 49152)", tok_path, False, smol_ids),
    ]
    for label, path, byte_vocab, ids in cases:
        for cls in (Llg, Xgr):
            if cls is Xgr and importlib.util.find_spec("xgrammar") is None:
                print(f"{label:26s} xgrammar   not installed (pip install xgrammar)")
                continue
            t0 = time.perf_counter()
            if cls is Llg:
                lib = cls(None if path is None else path.read_text(), byte_vocab)
            else:
                lib = cls(None if path is None else str(path.parent), byte_vocab)
            setup = 1e3 * (time.perf_counter() - t0)
            res = run(lib, ids, args.steps)
            cells = " ".join(f"{k}={v:.3f}" for k, v in res.items())
            print(f"{label:26s} {cls.name:10s} tokenizer_ms={setup:.0f} {cells}", flush=True)


if __name__ == "__main__":
    main()
