"""Sampling parameters: a wire type (GENERATE, HANDOFF) and the sampler's input. No torch here,
so the protocol and the CLI's client commands import without it; the sampler is
common.model.sampling, which re-exports these names.
"""

from __future__ import annotations

import math
import secrets

import msgspec

from common.errors import PdkvError


class SamplingParamsError(PdkvError, ValueError):
    """Sampling parameters outside their domain; the message names the field and its range."""


#: Temperatures below this are greedy: dividing logits by less would only pick among the tied
#: maxima, and a subnormal divisor overflows fp32 (see common.model.sampling).
MIN_TEMPERATURE = 1e-5
#: Highest temperature accepted; beyond it the distribution is uniform to fp32 precision anyway.
MAX_TEMPERATURE = 1e4


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to pick tokens. Client → prefill daemon → decode daemon (inside HANDOFF).

    temperature 0 (or anything below MIN_TEMPERATURE) is greedy (top_k, top_p and seed are then
    ignored); top_k 0 and top_p 1.0 are off; any top_p in (0, 1] keeps at least the likeliest token. `seed` makes sampling reproducible; `ignore_eos` keeps generating to max_tokens.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """True when tokens are the argmax (temperature below MIN_TEMPERATURE, 0 included)."""
        return self.temperature < MIN_TEMPERATURE

    def validate(self) -> SamplingParams:
        """Return self when every field is in range; SamplingParamsError naming the first that is not."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamsError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
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
        return self

    def with_seed(self) -> SamplingParams:
        """These parameters with a random seed filled in when sampling is random and none was given."""
        if self.seed is not None or self.greedy:
            return self
        return msgspec.structs.replace(self, seed=secrets.randbits(63))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and not math.isnan(x)
