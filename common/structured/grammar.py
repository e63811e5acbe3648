"""The grammar interface: a StructuredOutput compiled against a tokenizer, and a matcher per
sequence that says which tokens may come next.

`GrammarBackend.compile(structured)` → `Compiled` (GrammarError naming the problem when the spec
does not compile); `Compiled.matcher()` → a fresh `Matcher` at the start of the text. A matcher
fills its row of a bitmask (common.structured.bitmask) with the tokens allowed next, accepts the
token drawn, says when the grammar is `terminated` (nothing but an end token may follow: the
sequence ends there, finish_reason "stop"), and rolls back. One implementation,
`LlguidanceBackend` (llguidance: chosen by measurement, docs/benchmarks.md "Grammar libraries");
another library fits behind the same three methods.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import torch

from common.sampling_params import SamplingParamsError, StructuredOutput

#: llguidance's name for each StructuredOutput kind (grammar: Lark, or GBNF converted to it)
_FORMATS = {
    "json_object": "json_schema",
    "json_schema": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
_ANY_OBJECT = '{"type": "object"}'
#: JSON laid out as json.dumps does ("a, b", "k: v"), no other whitespace: a model cannot pad an
#: answer with whitespace until max_tokens (a schema's own "x-guidance" may say otherwise)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(SamplingParamsError):
    """A structured spec that does not compile; the message names the kind and the problem."""


class Matcher(Protocol):
    """One sequence's place in its grammar. Not thread-safe: one thread at a time."""

    def fill(self, mask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of the host int32 bitmask `mask`."""

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar forbids it (the matcher is then broken:
        the sequence ends; a masked draw never gets here)."""

    @property
    def terminated(self) -> bool:
        """Whether the text is complete and nothing but an end token may follow."""

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens."""


class Compiled(Protocol):
    """A grammar compiled for one tokenizer; immutable, shared by every request that uses it."""

    def matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str
    vocab_size: int

    def compile(self, structured: StructuredOutput) -> Compiled: ...


class _LlgMatcher:
    __slots__ = ("_m",)

    def __init__(self, m: Any) -> None:
        self._m = m

    def fill(self, mask: torch.Tensor, row: int) -> None:
        v = mask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def rollback(self, n: int) -> None:
        self._m.rollback(n)

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class _LlgCompiled:
    """A pristine matcher, copied for each sequence (llguidance's compiled state is shared)."""

    __slots__ = ("_pristine",)

    def __init__(self, pristine: Any) -> None:
        self._pristine = pristine

    def matcher(self) -> _LlgMatcher:
        return _LlgMatcher(self._pristine.deep_copy())


class LlguidanceBackend:
    """llguidance over the daemon's tokenizer: a `tokenizers` JSON (`tokenizer_json`) or, without
    one, the built-in byte tokenizer (ids 0..255 are bytes, the rest special). `vocab_size` is
    the model's (the logits' width: ids past the tokenizer's are never allowed); `eos_ids` the
    tokens that end a text (the model's stop ids). An added token that is not special (Qwen's
    `<tool_call>`, `<think>`) is its text, as the tokenizer's decoder treats it; a special one
    is never text (`_from_json`)."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_ids: list[int]) -> None:
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        eos = sorted(eos_ids)
        if tokenizer_json is None:
            wrapper = llguidance.TokenizerWrapper(_ByteVocab(vocab_size, eos[0]))
            self._tok = llguidance.LLTokenizer(wrapper, eos_token=eos)
        else:
            self._tok = _from_json(llguidance, tokenizer_json, vocab_size, eos)

    def compile(self, structured: StructuredOutput) -> _LlgCompiled:
        llg, kind = self._llg, structured.kind
        text = _ANY_OBJECT if kind == "json_object" else structured.spec
        try:
            if _FORMATS[kind] == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
            else:
                grammar = llg.grammar_from(_FORMATS[kind], text)  # type: ignore[arg-type]
            why = llg.LLMatcher.validate_grammar(grammar, self._tok)
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise GrammarError(f"structured {kind} does not compile: {exc}") from None
        if why and not why.startswith("WARNING"):
            raise GrammarError(f"structured {kind} does not compile: {why}")
        pristine = llg.LLMatcher(self._tok, grammar, log_level=0)
        if pristine.is_error():
            raise GrammarError(f"structured {kind} does not compile: {pristine.get_error()}")
        return _LlgCompiled(pristine)


def _from_json(llg: Any, tokenizer_json: str, vocab_size: int, eos: list[int]) -> Any:
    """llguidance's tokenizer of a `tokenizers` JSON in which only special tokens are special.

    llguidance's own reading (LLTokenizer(json), and so llguidance.hf's from_tokenizer) marks
    every added token special (the marker byte 0xFF before its name) and spells a grammar's text
    with the tokenizer, which splits every added token's name out of it: a grammar whose text
    contains `<tool_call>` (an added token that is not special: Qwen's) or `<|im_end|>` (a
    special one) allowed that token there and refused it when fed back (0xFF is not '<'). Here
    the bytes llguidance read go back to it with what it marked special marked so again, but for
    the added tokens that are not special (their text, as the decoder writes them), and text is
    spelled as llguidance spells it but a special token's name in bytes (`_Vocab`)."""
    native = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    special, text = _added(tokenizer_json)
    marked = [i for i in range(vocab_size) if native.is_special_token(i) and i not in text]
    vocab = _Vocab(native, vocab_size, eos[0], special, marked)
    return llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=vocab_size, eos_token=eos)


def _added(tokenizer_json: str) -> tuple[dict[int, str], set[int]]:
    """The added tokens of `tokenizer_json`: the special ones (id: name), and the ids of those
    that are not (Qwen's `<tool_call>`, `<think>`: text, the decoder keeps them)."""
    added = json.loads(tokenizer_json).get("added_tokens") or []
    special = {int(t["id"]): t["content"] for t in added if t.get("special", False)}
    return special, {int(t["id"]) for t in added} - set(special)


class _Vocab:
    """A tokenizer as llguidance's TokenizerWrapper reads it: every id's bytes as `native` (an
    LLTokenizer) decodes them, `marked` the ids llguidance is to mark special. Text is spelled by
    `native`, each of the `special` tokens (id: name) it splits out respelled from its name
    (greedily: a special token is never part of a text)."""

    def __init__(
        self, native: Any, vocab_size: int, eos: int, special: dict[int, str], marked: list[int]
    ) -> None:
        self.eos_token_id = eos
        self.bos_token_id = None
        self.tokens = [native.decode_bytes([i]) for i in range(vocab_size)]
        self.special_token_ids = marked
        self._native, self._special = native, special

    def __call__(self, text: bytes) -> list[int]:
        ids = self._native.tokenize_bytes(text)
        if not any(t in self._special for t in ids):
            return list(ids)
        out: list[int] = []
        for t in ids:
            name = self._special.get(t)
            out.extend([t] if name is None else self._native.greedy_tokenize(name))
        return out


class _ByteVocab:
    """The byte tokenizer as llguidance's TokenizerWrapper reads it."""

    def __init__(self, vocab_size: int, eos: int) -> None:
        self.eos_token_id = eos
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [
            f"<special_{i}>".encode() for i in range(256, vocab_size)
        ]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


__all__ = [
    "JSON_LAYOUT",
    "Compiled",
    "GrammarBackend",
    "GrammarError",
    "LlguidanceBackend",
    "Matcher",
]
