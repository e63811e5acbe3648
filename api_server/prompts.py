"""The prompts of a request, and the context-length check the API can make before the daemons.

/v1/completions takes `prompt` in every form OpenAI accepts: a string, a list of strings, a list
of token ids, or a list of token-id lists; each prompt is one choice (its `index` is its place in
the list). A text prompt's tokens are counted by the daemons, which refuse one that does not fit
in the model's context (common.context_length); a token-id prompt, and `max_tokens` alone, are
checked here first.
"""

from __future__ import annotations

from dataclasses import dataclass

from api_server.errors import bad_field, context_exceeded
from common.context_length import context_error

#: Prompts in one request; each runs as its own daemon request, all at once.
MAX_PROMPTS = 256
_MAX_ID = 2**31


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text, or its token ids."""

    text: str | None = None
    tokens: list[int] | None = None


def prompts_of(prompt: str | list[str | int | list[int]]) -> list[Prompt]:
    """The prompts of a completion request's `prompt`; 400 naming `prompt` when the form is
    none of OpenAI's."""
    if isinstance(prompt, str):
        return [Prompt(text=prompt)]
    kinds = {type(p) for p in prompt}
    if kinds == {str}:
        prompts = [Prompt(text=p) for p in prompt]  # type: ignore[arg-type]
    elif kinds == {int}:
        prompts = [Prompt(tokens=_ids(prompt, "prompt"))]  # type: ignore[arg-type]
    elif kinds == {list}:
        prompts = [Prompt(tokens=_ids(p, f"prompt[{i}]")) for i, p in enumerate(prompt)]  # type: ignore[arg-type]
    else:
        raise bad_field(
            "prompt",
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists" + (", not an empty list" if not prompt else "; this list mixes them"),
        )
    if len(prompts) > MAX_PROMPTS:
        raise bad_field(
            "prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}"
        )
    return prompts


def _ids(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise bad_field(param, "a prompt of token ids must hold at least one id")
    if not all(0 <= t < _MAX_ID for t in ids):
        raise bad_field(param, f"token ids must be integers in [0, {_MAX_ID})")
    return ids


def check_context(
    prompts: list[Prompt], max_tokens: int, max_positions: int, max_tokens_param: str
) -> None:
    """400 `context_length_exceeded` when a token-id prompt with `max_tokens`, or `max_tokens`
    alone, cannot fit in `max_positions`; the param blamed is `prompt` when the prompt alone
    fills the context, else `max_tokens_param` (the request's name for it)."""
    for p in prompts:
        count = len(p.tokens) if p.tokens is not None else None
        if why := context_error(count, max_tokens, max_positions):
            raise context_exceeded("prompt" if why.startswith("prompt") else max_tokens_param, why)
