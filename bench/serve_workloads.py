"""Workloads with repeats for bench/serve.py, made from a plain one (serve_load.make_workload):

- shared prefix (`--shared-prefix N`): every prompt starts with the same N tokens, then its own
  drawn ones (a system prompt, tool descriptions);
- multi-turn (`--turns T`): the requests form conversations of T turns; turn k re-sends turn k-1's
  prompt, an answer of turn k-1's output length, and its own new part (its drawn prompt), and is
  sent once turn k-1 ended. The answer is drawn, not the model's: it is the same on every target
  and needs no round trip before the workload exists (the prefill caches prompt blocks only, so a
  drawn answer is reused exactly as a real one would be).

Both are deterministic in the seed; the lengths drawn for the plain workload are kept.
"""

from __future__ import annotations

import dataclasses
import random

from serve_load import RequestSpec


def shared_prefix(specs: list[RequestSpec], n: int, vocab: int, seed: int) -> list[RequestSpec]:
    """Every prompt behind the same `n` tokens."""
    rng = random.Random(seed + 2)
    prefix = [rng.randrange(vocab) for _ in range(n)]
    return [dataclasses.replace(s, prompt=prefix + s.prompt) for s in specs]


def multi_turn(specs: list[RequestSpec], turns: int, vocab: int, seed: int) -> list[RequestSpec]:
    """Consecutive groups of `turns` requests become conversations (see the module docstring);
    a conversation keeps its first request's arrival."""
    rng = random.Random(seed + 3)
    out: list[RequestSpec] = []
    for s in specs:
        turn = s.index % turns
        if turn == 0:
            out.append(s)
            continue
        prev = out[-1]
        answer = [rng.randrange(vocab) for _ in range(prev.output_len)]
        prompt = prev.prompt + answer + s.prompt
        out.append(
            dataclasses.replace(
                s, prompt=prompt, arrival_s=prev.arrival_s, after=prev.index, turn=turn
            )
        )
    return out


__all__ = ["multi_turn", "shared_prefix"]
