"""OpenAI's `logprobs` objects from the daemons' entries, and `echo`'s prompt.

Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one item per
token; with `echo` the prompt's tokens come first, the first of them with a null logprob and
null top_logprobs (nothing predicts it), as OpenAI answers. `text_offset` is each token's offset
in the choice's `text` (which with echo starts with the prompt). Chat: `{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}`.

A token's text is its own decoding (special tokens by name); several ids with the same text
share one key of a legacy `top_logprobs` dict (the likeliest stays), as in vLLM. Logprobs are of
the model's raw logits (see common.sampling_params); with a stop string the entries of the token
that held it are included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from api_server.tokens import PromptCounter
from common.sampling_params import TokenLogprob


@dataclass(frozen=True)
class Echo:
    """What `echo` puts before a choice: the prompt's text and its first token's id."""

    text: str
    first_token: int

    @classmethod
    def of(cls, counter: PromptCounter, text: str | None, tokens: list[int] | None) -> Echo:
        ids = tokens if tokens is not None else counter.encode(text or "")
        return cls(text if text is not None else counter.decode(ids), ids[0])


@dataclass
class ChoiceLogprobs:
    """One choice's entries as they arrive: the prompt's (tokens 1..) and the generated ones."""

    prompt: list[TokenLogprob] = field(default_factory=list)
    generated: list[TokenLogprob] = field(default_factory=list)


class LogprobFormat:
    def __init__(self, counter: PromptCounter) -> None:
        self.counter = counter
        self._texts: dict[int, tuple[str, list[int]]] = {}

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        if (hit := self._texts.get(token_id)) is None:
            hit = self._texts[token_id] = self.counter.token(token_id)
        return hit

    def completion(
        self,
        entries: list[TokenLogprob],
        *,
        echo: Echo | None = None,
        prompt: list[TokenLogprob] = (),  # type: ignore[assignment]
        offset: int = 0,
    ) -> dict[str, Any]:
        """The legacy object of `entries` (with echo: of the prompt first), offsets from
        `offset`."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if echo is not None:
            tokens.append(self._token(echo.first_token)[0])
            token_logprobs.append(None)
            tops.append(None)
        for e in [*(prompt if echo is not None else ()), *entries]:
            tokens.append(self._token(e.token)[0])
            token_logprobs.append(e.logprob)
            top: dict[str, float] = {}
            for tid, lp in e.top:
                top.setdefault(self._token(tid)[0], lp)
            tops.append(top)
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """The chat object of `entries`."""
        content = []
        for e in entries:
            text, raw = self._token(e.token)
            top = []
            for tid, lp in e.top:
                t, b = self._token(tid)
                top.append({"token": t, "logprob": lp, "bytes": b})
            content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content, "refusal": None}
