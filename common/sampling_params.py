"""Sampling parameters: a wire type (GENERATE, HANDOFF) and the sampler's input. No torch here,
so the protocol and the CLI's client commands import without it; the sampler is
common.model.sampling, which re-exports these names.
"""

from __future__ import annotations

import math
import secrets
from typing import Annotated

import msgspec

from common.errors import PdkvError


class SamplingParamsError(PdkvError, ValueError):
    """Sampling parameters outside their domain; the message names the field and its range."""


#: Temperatures below this are greedy: dividing logits by less would only pick among the tied
#: maxima, and a subnormal divisor overflows fp32 (see common.model.sampling).
MIN_TEMPERATURE = 1e-5
#: Highest temperature accepted; beyond it the distribution is uniform to fp32 precision anyway.
MAX_TEMPERATURE = 1e4
#: Most alternatives a token's logprobs may list (OpenAI's top_logprobs bound).
MAX_LOGPROBS = 20
#: Most stop_token_ids one request may give.
MAX_STOP_TOKEN_IDS = 64
#: presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range).
MAX_PENALTY = 2.0
#: What a request's `structured` constraint may be (issue 42): JSON (any object), JSON under a
#: schema, a regular expression, one of a list of strings, or a grammar.
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
#: Longest `structured.spec` one request may send (a schema, pattern, choice list or grammar).
MAX_STRUCTURED_SPEC = 256 * 1024


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A constraint on the generated text, enforced where tokens are chosen.

    `kind` is one of STRUCTURED_KINDS; `spec` is its text: the JSON schema (json_schema), the
    pattern (regex), a JSON array of strings (choice), the grammar (grammar); "" for json_object.
    """

    kind: str
    spec: str = ""

    def validate(self) -> StructuredOutput:
        """Return self when the kind is known and the spec bounded; SamplingParamsError if not."""
        if self.kind not in STRUCTURED_KINDS:
            raise SamplingParamsError(
                f"structured.kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_SPEC:
            raise SamplingParamsError(
                f"structured.spec must be a string of at most {MAX_STRUCTURED_SPEC} characters"
            )
        if self.kind == "json_object" and self.spec:
            raise SamplingParamsError('structured.spec must be "" for kind json_object')
        if self.kind != "json_object" and not self.spec:
            raise SamplingParamsError(f"structured.spec must not be empty for kind {self.kind}")
        return self


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to pick tokens. Client → prefill daemon → decode daemon (inside HANDOFF).

    temperature 0 (or anything below MIN_TEMPERATURE) is greedy (top_k, top_p and seed are then
    ignored); top_k 0 and top_p 1.0 are off; any top_p in (0, 1] keeps at least the likeliest
    token. `seed` makes sampling reproducible; `ignore_eos` keeps generating to max_tokens past
    the model's EOS.

    `logprobs` k (0..MAX_LOGPROBS; None: off): each generated token comes with its logprob and
    the k likeliest alternatives; `prompt_logprobs` k: the same for every prompt token but the
    first (the prefill computes logits at every prompt position only then). Logprobs are the
    log-softmax of the model's raw logits (before penalties and temperature, as vLLM's default).
    max_tokens 0 is allowed only with prompt_logprobs (score a prompt, generate nothing).

    Penalties (neutral: 0, 0, 1): `presence_penalty` and `frequency_penalty` in [-2, 2] subtract
    p * (count > 0) and f * count from the logits of the tokens generated so far (OpenAI's and
    vLLM's rule); `repetition_penalty` > 0 divides the positive logits (multiplies the negative
    ones) of every token of prompt + generated (HF's RepetitionPenaltyLogitsProcessor).
    `min_tokens`: EOS and `stop_token_ids` cannot be drawn before that many tokens;
    `stop_token_ids` end the sequence ("stop") like EOS, even with ignore_eos.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    structured: StructuredOutput | None = None

    @property
    def penalized(self) -> bool:
        """True when some penalty is not at its neutral value."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax (temperature below MIN_TEMPERATURE, 0 included)."""
        return self.temperature < MIN_TEMPERATURE

    def validate(self) -> SamplingParams:
        """Return self when every field is in range; SamplingParamsError naming the first that is not."""
        lowest = 0 if self.prompt_logprobs is not None else 1
        if not _is_int(self.max_tokens) or self.max_tokens < lowest:
            raise SamplingParamsError(
                f"max_tokens must be an integer >= 1 (0 only with prompt logprobs), "
                f"got {self.max_tokens!r}"
            )
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingParamsError(
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (below "
                f"{MIN_TEMPERATURE:g} = greedy), got {self.temperature!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingParamsError(
                f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"
            )
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise SamplingParamsError(f"seed must be an integer or null, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        self._validate_extras()
        return self

    def _validate_extras(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise SamplingParamsError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}] or null, got {k!r}"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise SamplingParamsError(
                    f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}"
                )
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0.0 < rp <= MAX_TEMPERATURE:
            raise SamplingParamsError(
                f"repetition_penalty must be a number in (0, {MAX_TEMPERATURE:g}] (1 = off), "
                f"got {rp!r}"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise SamplingParamsError(
                f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
            )
        ids = self.stop_token_ids
        if len(ids) > MAX_STOP_TOKEN_IDS or not all(_is_int(t) and t >= 0 for t in ids):
            raise SamplingParamsError(
                f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} integers >= 0, got {ids!r}"
            )
        if self.structured is not None:
            self.structured.validate()

    def with_seed(self) -> SamplingParams:
        """These parameters with a random seed filled in when sampling is random and none was given."""
        if self.seed is not None or self.greedy:
            return self
        return msgspec.structs.replace(self, seed=secrets.randbits(63))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and not math.isnan(x)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One token's logprob and its `top` alternatives as (id, logprob) pairs, likeliest first
    (at most MAX_LOGPROBS). On the wire (TOKENS) an array `[token, logprob, [[id, lp], ...]]`.
    Logprobs are finite: -inf (a token of probability 0 in fp32) is sent as LOGPROB_FLOOR."""

    token: Annotated[int, msgspec.Meta(ge=0)]
    logprob: float
    top: Annotated[list[tuple[int, float]], msgspec.Meta(max_length=MAX_LOGPROBS)] = []


#: What a logprob of -inf is sent as (JSON has no infinity); vLLM's API does the same.
LOGPROB_FLOOR = -9999.0
