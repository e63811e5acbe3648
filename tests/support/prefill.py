"""The prefill's tests' helpers: a burst client, the prefill's JSON log lines, random prompts, and
the prefix cache's rule for the tokens a prompt finds cached."""

from __future__ import annotations

import asyncio
import json
import random

from common.protocol import Error, Finish, Generate, Tokens, encode
from common.wire.channel import connect
from tests.support.daemons import BLOCK, Pair


async def burst(sock: str, gens: list[Generate]) -> dict[str, list[int] | Error]:
    """Send every GENERATE in one write on one connection, so all of them are in the daemon
    before its first forward returns; each request's tokens, or its ERROR."""
    channel = await connect(sock)
    try:
        await channel.send_bytes(b"".join(encode(g) for g in gens))
        out: dict[str, list[int] | Error] = {g.request_id: [] for g in gens}
        waiting = set(out)
        while waiting:
            msg = await asyncio.wait_for(channel.recv(), 120)
            if isinstance(msg, Tokens):
                out[msg.request_id].extend(msg.tokens)  # type: ignore[union-attr]
            elif isinstance(msg, Error):
                out[msg.request_id] = msg
                waiting.discard(msg.request_id)
            elif isinstance(msg, Finish):
                waiting.discard(msg.request_id)
        return out
    finally:
        channel.close()


def events(pair: Pair, name: str) -> list[dict]:
    """The prefill's JSON log lines of event `name`, in order."""
    lines = pair.daemons["prefill"].log_text().splitlines()
    parsed = [json.loads(line) for line in lines if line.startswith("{")]
    return [e for e in parsed if e.get("event") == name]


def prompts(n: int, lengths: list[int], seed: int = 3) -> list[list[int]]:
    """n prompts of random byte ids, their lengths cycling through `lengths`."""
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def expected_hit(history: list[list[int]], prompt: list[int]) -> int:
    """Cached tokens the rule predicts: full blocks shared with an earlier prompt, from the
    start, not the block of the last token."""
    best = 0
    for old in history:
        same = 0
        while same < min(len(old), len(prompt)) and old[same] == prompt[same]:
            same += 1
        best = max(best, same // BLOCK)
    return min(best, (len(prompt) - 1) // BLOCK) * BLOCK
