"""The grammar library's view of a tokenizer built before the first constrained request.

Building it takes ~0.4-1 s for a 50k-128k vocabulary (llguidance reads every token, and pdkv
hands them back to it: grammar._from_json); made on
first use, that lands in the first constrained request's TTFT, in every process that compiles
(the API to check a spec, the prefill at admission, the decode at HANDOFF). Each process starts
it on a thread of its own when it learns its tokenizer; a request that comes meanwhile waits on
the cache's lock for the build, never builds a second one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger(__name__)


def warm_in_background(build: Callable[[], object], **fields: object) -> threading.Thread:
    """Run `build` (e.g. `lambda: grammars_for(tokenizer, vocab, eos)`) on a daemon thread;
    log `grammars_warmed` with its seconds, or `grammar_warm_failed` (constrained requests then
    fail with that error when they come; serving goes on). `fields` go into both lines."""

    def run() -> None:
        started = time.perf_counter()
        try:
            build()
        except Exception as exc:  # a tokenizer the library cannot read
            log.warning("grammar_warm_failed", error=f"{type(exc).__name__}: {exc}", **fields)
            return
        log.info("grammars_warmed", seconds=round(time.perf_counter() - started, 3), **fields)

    thread = threading.Thread(target=run, name="grammar-warm", daemon=True)
    thread.start()
    return thread


def warm_runtime(rt: Any, role: str) -> threading.Thread:
    """A daemon's grammar cache (its ModelRuntime's tokenizer and model config) built in the
    background."""
    from common.structured.cache import grammars_for

    config = rt.model.config
    return warm_in_background(
        lambda: grammars_for(rt.tokenizer, config.vocab_size, config.stop_token_ids), role=role
    )


__all__ = ["warm_in_background", "warm_runtime"]
