"""Compiled grammars cached across requests: one bounded LRU per tokenizer, keyed by (kind, spec).

`grammars_for(tokenizer, vocab_size, eos_ids)` gives a process's cache for its tokenizer (the
daemons: the model's; the API: the one it counts prompts with), made on first use (building
the grammar library's view of a 49k vocabulary takes ~0.2 s). `GrammarCache.compile` is
thread-safe: the loop compiles at admission, the torch thread finds it there.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from common.sampling_params import StructuredOutput
from common.structured.grammar import Compiled, GrammarBackend, LlguidanceBackend

#: compiled grammars kept per tokenizer (a compiled JSON schema is tens of kB)
CACHE_SIZE = 256


class GrammarCache:
    """LRU of compiled grammars for one backend (one tokenizer). `compiles`, `hits` and
    `compile_s` (total seconds spent compiling, failures included) are for metrics."""

    def __init__(self, backend: GrammarBackend, capacity: int = CACHE_SIZE) -> None:
        self.backend = backend
        self.capacity = capacity
        self._lru: OrderedDict[tuple[str, str], Compiled] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0
        self.hits = 0
        self.compile_s = 0.0

    def cached(self, structured: StructuredOutput) -> Compiled | None:
        """The compiled grammar of `structured` when the cache has it (a hit), else None; never
        compiles, so an event loop may ask (the lock is never held during a compile)."""
        key = (structured.kind, structured.spec)
        with self._lock:
            found = self._lru.get(key)
            if found is not None:
                self._lru.move_to_end(key)
                self.hits += 1
            return found

    def compile(self, structured: StructuredOutput) -> Compiled:
        """The compiled grammar of `structured` (from the cache when seen); GrammarError naming
        the problem when it does not compile (not cached: a retry compiles again)."""
        found = self.cached(structured)
        if found is not None:
            return found
        key = (structured.kind, structured.spec)
        started = time.perf_counter()
        try:
            compiled = self.backend.compile(structured)
        finally:
            with self._lock:
                self.compiles += 1
                self.compile_s += time.perf_counter() - started
        with self._lock:
            self._lru[key] = compiled
            while len(self._lru) > self.capacity:
                self._lru.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._lru)


_caches: dict[tuple[int, int, tuple[int, ...]], GrammarCache] = {}
_caches_lock = threading.Lock()


def grammars_for(
    tokenizer: Any, vocab_size: int, eos_ids: frozenset[int] | set[int]
) -> GrammarCache:
    """This process's grammar cache for `tokenizer` (an HFTokenizer, or the ByteTokenizer: None
    JSON), logits `vocab_size` wide, texts ended by `eos_ids`."""
    eos = tuple(sorted(eos_ids))
    key = (id(tokenizer), vocab_size, eos)
    with _caches_lock:
        cache = _caches.get(key)
        if cache is None:
            raw = getattr(tokenizer, "raw", None)
            json_text = None if raw is None else raw.to_str()
            cache = _caches[key] = GrammarCache(LlguidanceBackend(json_text, vocab_size, list(eos)))
            cache.owner = tokenizer  # type: ignore[attr-defined]  # keeps id() unique
        return cache


def cached_grammar(
    tokenizer: Any,
    vocab_size: int,
    eos_ids: frozenset[int] | set[int],
    structured: StructuredOutput,
) -> Compiled | None:
    """`grammars_for(...).compile(structured)` when both the cache and the grammar are there
    already, else None (then compile off the loop): never builds, compiles or waits for a build
    (the warm thread holds the caches' lock while it builds), so an event loop may ask."""
    cache = _caches.get((id(tokenizer), vocab_size, tuple(sorted(eos_ids))))
    return None if cache is None else cache.cached(structured)


__all__ = ["CACHE_SIZE", "GrammarCache", "cached_grammar", "grammars_for"]
