"""Concurrent client load with a bound on every request: each ends as FINISH or an error code."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from common import client
from common.model.sampling import SamplingParams


@dataclass
class Outcome:
    """How one request ended as its client saw it: `end` is "FINISH", an ErrorCode, or an error."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    end: str = ""


@dataclass
class Load:
    """`n` concurrent generations; `tokens_seen` counts every token any client received."""

    socket: str
    n: int
    max_tokens: int
    prompt_len: int = 20
    timeout: float = 60.0
    seed: int = 11
    tokens_seen: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(256) for _ in range(self.prompt_len + i % 7)] for i in range(self.n)]

    async def _one(self, i: int, prompt: list[int]) -> Outcome:
        out = Outcome(request_id=f"load{self.seed}-{i}")
        params = SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)
        try:
            async for msg in client.stream(
                self.socket,
                prompt_tokens=prompt,
                sampling=params,
                request_id=out.request_id,
                timeout=self.timeout,
            ):
                if isinstance(msg, client.Tokens):
                    out.tokens.extend(msg.tokens)
                    self.tokens_seen += len(msg.tokens)
                else:
                    out.end = "FINISH"
        except client.RequestFailed as exc:
            out.end = str(exc.code)
        except (OSError, client.PdkvError, TimeoutError) as exc:
            out.end = type(exc).__name__
        return out

    async def run(self) -> list[Outcome]:
        """Every request, each bounded by `timeout` seconds (a hang ends as "HUNG")."""

        async def bounded(i: int, p: list[int]) -> Outcome:
            try:
                return await asyncio.wait_for(self._one(i, p), self.timeout)
            except TimeoutError:
                return Outcome(request_id=f"load{self.seed}-{i}", end="HUNG")

        self.outcomes = list(
            await asyncio.gather(*(bounded(i, p) for i, p in enumerate(self.prompts())))
        )
        return self.outcomes

    async def wait_tokens(self, n: int, timeout: float = 60.0) -> None:
        """Return once `n` tokens in all have reached the clients."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.tokens_seen < n:
            assert loop.time() < deadline, f"only {self.tokens_seen} tokens flowed in {timeout}s"
            await asyncio.sleep(0.01)
