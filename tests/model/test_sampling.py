"""SamplingParams validation, the sampler's support restrictions, seeding and stop rules."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from common.model import (
    SamplingParams,
    SamplingParamsError,
    finish_reason,
    make_generator,
    sample,
    sample_batch,
)
from common.model.sampling import SamplingError, sample_batch_isolated


def _logits(seed: int = 0, vocab: int = 64) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(logits: torch.Tensor, params: SamplingParams, n: int = 300) -> list[int]:
    return [sample(logits, params, make_generator(params, step)) for step in range(n)]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_validate_names_the_bad_field(fields: dict, field: str) -> None:
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**fields).validate()


def test_valid_params_round_trip_through_json() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.7, top_k=3, top_p=0.9, seed=11).validate()
    wire = msgspec.json.encode(params)
    assert msgspec.json.decode(wire, type=SamplingParams) == params


def test_greedy_is_argmax_and_needs_no_generator() -> None:
    for seed in range(5):
        logits = _logits(seed)
        assert make_generator(SamplingParams(), 0) is None
        assert sample(logits, SamplingParams(), None) == int(logits.argmax())


def test_same_seed_and_step_give_the_same_draw_and_steps_differ() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    flat = torch.zeros(64)  # uniform: any repetition pattern would show
    first = _draws(flat, params, 50)
    assert first == _draws(flat, params, 50)
    assert len(set(first)) > 20
    assert first != _draws(flat, msgspec.structs.replace(params, seed=43), 50)


def test_top_k_restricts_the_support_to_the_k_largest() -> None:
    logits = _logits(1)
    params = SamplingParams(temperature=5.0, top_k=3, seed=0)
    top3 = set(logits.topk(3).indices.tolist())
    draws = set(_draws(logits, params))
    assert draws == top3


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]).log()[torch.tensor([3, 0, 4, 1, 2])]
    # ids by probability: 1 (0.5), 3 (0.3), 4 (0.1), 0 (0.06), 2 (0.04)
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=1))) == {1, 3}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.85, seed=1))) == {1, 3, 4}
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.4, seed=1))) == {1}


def test_sample_batch_equals_row_by_row_sampling() -> None:
    logits = torch.stack([_logits(s) for s in range(4)])
    params = [
        SamplingParams(),
        SamplingParams(temperature=2.0, seed=5),
        SamplingParams(temperature=1.0, top_k=4, seed=6),
        SamplingParams(temperature=1.0, top_p=0.5, seed=7),
    ]
    expected = [sample(row, p, make_generator(p, 3)) for row, p in zip(logits, params, strict=True)]
    assert sample_batch(logits, params, [make_generator(p, 3) for p in params]) == expected


def test_with_seed_fills_a_seed_only_for_random_sampling() -> None:
    assert SamplingParams().with_seed().seed is None
    assert SamplingParams(temperature=1.0, seed=3).with_seed().seed == 3
    assert SamplingParams(temperature=1.0).with_seed().seed is not None


def test_finish_reason() -> None:
    stop = frozenset({9})
    assert finish_reason([1, 2], SamplingParams(max_tokens=3), stop) is None
    assert finish_reason([1, 2, 3], SamplingParams(max_tokens=3), stop) == "length"
    assert finish_reason([1, 9], SamplingParams(max_tokens=3), stop) == "stop"
    assert finish_reason([1, 9], SamplingParams(max_tokens=3, ignore_eos=True), stop) is None


# ---- numerical safety (issue 14): every valid parameter, and non-finite logits -----------------
@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 8.9e-38, "top_k": 0, "seed": 7},
        {"temperature": 5e-324, "seed": 7},
        {"temperature": 1e-5, "seed": 7},
        {"temperature": 0.7, "top_p": 1e-300, "seed": 7},
        {"temperature": 0.7, "top_p": 5e-324, "seed": 7},
        {"temperature": 1e4, "top_p": 1e-300, "top_k": 2**62, "seed": 7},
    ],
)
def test_extreme_valid_parameters_draw_a_token(fields: dict) -> None:
    params = SamplingParams(**fields).validate()
    logits = _logits(3)
    got = _draws(logits, params, n=20)
    assert all(0 <= t < logits.numel() for t in got)
    if params.temperature < 1e-4 or params.top_p < 1e-100:  # all the mass on the likeliest
        assert set(got) == {int(torch.argmax(logits))}


def test_tiny_temperatures_are_greedy_and_huge_ones_are_refused() -> None:
    assert SamplingParams(temperature=5e-324).greedy
    assert SamplingParams(temperature=9.9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=1e5).validate()


def test_nan_entries_are_never_drawn_and_inf_entries_share_the_mass() -> None:
    params = SamplingParams(temperature=0.7, seed=3)
    logits = _logits(1)
    logits[::2] = math.nan
    assert all(t % 2 == 1 for t in _draws(logits, params, n=50))
    logits[5] = logits[9] = math.inf
    assert set(_draws(logits, params, n=100)) == {5, 9}


def test_a_row_with_nothing_to_draw_fails_alone() -> None:
    logits = torch.stack([_logits(0), torch.full((64,), math.nan), _logits(2)])
    params = [SamplingParams(temperature=0.7, seed=s) for s in range(3)]
    gens = [make_generator(p, 0) for p in params]
    out = sample_batch_isolated(logits, params, gens)
    assert isinstance(out[1], SamplingError) and "not finite" in str(out[1])
    assert out[0] == sample(logits[0], params[0], make_generator(params[0], 0))
    assert out[2] == sample(logits[2], params[2], make_generator(params[2], 0))
    with pytest.raises(SamplingError):
        sample(torch.full((8,), -math.inf), params[0], gens[0])
