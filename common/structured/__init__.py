"""Structured output (issue 42): grammars compiled per tokenizer and cached, a matcher per
constrained sequence, and the one masked pass over a batch's logits (bitmask.apply)."""

from common.structured.cache import CACHE_SIZE, GrammarCache, cached_grammar, grammars_for
from common.structured.grammar import Compiled, GrammarBackend, GrammarError, Matcher

__all__ = [
    "CACHE_SIZE",
    "Compiled",
    "GrammarBackend",
    "GrammarCache",
    "GrammarError",
    "Matcher",
    "cached_grammar",
    "grammars_for",
]
