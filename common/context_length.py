"""The model's context length: a prompt and the tokens asked for must fit in its positions.

One check for the prefill daemon's GENERATE and the HTTP API, so that both refuse the same
requests in the same words; the API recognises the daemon's refusal by MARKER in its message.
"""

from __future__ import annotations

MARKER = "the model's context length"


def context_error(prompt_tokens: int | None, max_tokens: int, max_positions: int) -> str | None:
    """None when a prompt of `prompt_tokens` (None: not counted yet, at least one) and
    `max_tokens` fit in `max_positions`, else why not. The message starts with the field at
    fault: `prompt` when the prompt alone leaves no room for one generated token, `max_tokens`
    otherwise."""
    if prompt_tokens is None:
        if max_tokens < max_positions:
            return None
        return (
            f"max_tokens {max_tokens} leaves no room for a prompt: {MARKER} is {max_positions} "
            "tokens (max_position_embeddings), prompt and generated tokens together"
        )
    if prompt_tokens + max_tokens <= max_positions:
        return None
    if prompt_tokens >= max_positions:
        return (
            f"prompt has {prompt_tokens} tokens: {MARKER} is {max_positions} tokens "
            "(max_position_embeddings), which leaves no room for a generated token"
        )
    return (
        f"max_tokens {max_tokens} with a prompt of {prompt_tokens} tokens exceeds {MARKER} of "
        f"{max_positions} tokens (max_position_embeddings): at most "
        f"{max_positions - prompt_tokens} can be generated after this prompt"
    )


def is_context_error(message: str) -> bool:
    """True for a refusal written by `context_error`."""
    return MARKER in message
