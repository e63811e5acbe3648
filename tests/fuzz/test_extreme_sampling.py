"""Property: extreme but schema-valid sampling parameters and prompts, sent through a real pair,
each get a whole answer (or a clean BAD_REQUEST), and the pair keeps serving correct requests.

Subnormal and huge temperatures, top_p down to the smallest double, top_k past the vocabulary,
any 64-bit seed, prompts at the length limit, text of any code points. After every example a
greedy canary must equal the single-process reference: a sampler or decode-loop failure that
stops decoding (issue 14) would hang or change it. The example count is modest: each one is a
few real requests through both daemons.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import client
from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from common.protocol import ErrorCode
from tests.support.daemons import BLOCK, FaultPair, all_free, new_pair
from tests.support.wait import poll

MAX_PROMPT = 64
CANARY = [7, 8, 9, 10]
CANARY_PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)

temperatures = st.one_of(
    st.just(0.0),
    st.floats(min_value=0.0, max_value=1e-4, allow_subnormal=True),
    st.floats(min_value=1e-4, max_value=1e4),
    st.sampled_from([5e-324, 8.9e-38, 1e-5, 1e4]),
)
top_ps = st.one_of(
    st.floats(min_value=5e-324, max_value=1.0, exclude_min=False, allow_subnormal=True),
    st.sampled_from([1e-300, 1.0]),
)
sampling = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 24),
    temperature=temperatures,
    top_k=st.one_of(st.integers(0, 4), st.integers(0, 2**63 - 1)),
    top_p=top_ps,
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    ignore_eos=st.booleans(),
)


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    return load_model(None)


@pytest.fixture(scope="module")
def xpair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultPair]:
    pair = new_pair(tmp_path_factory, "xs")
    pair.extra["prefill"] = ["--max-prompt-tokens", str(MAX_PROMPT)]
    pair.start_both()
    yield pair
    pair.kill_all()


def _generate(pair: FaultPair, params: SamplingParams, **prompt):  # type: ignore[no-untyped-def]
    return asyncio.run(client.generate(pair.client_socket, sampling=params, timeout=60, **prompt))


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    params=sampling,
    prompt=st.one_of(
        st.lists(st.integers(0, 255), min_size=1, max_size=MAX_PROMPT).map(
            lambda t: {"prompt_tokens": t}
        ),
        st.text(min_size=1, max_size=40).map(lambda t: {"prompt": t}),
    ),
)
def test_extreme_sampling_never_stops_the_pair(xpair, tiny, params, prompt):
    model, tok = tiny
    try:
        got = _generate(xpair, params, **prompt)
    except client.RequestFailed as exc:
        # only a prompt the limits refuse (text that encodes past MAX_PROMPT tokens)
        assert exc.code == ErrorCode.BAD_REQUEST, exc
        assert "prompt" in str(exc)
    else:
        assert got.finish is not None
        assert 1 <= len(got.tokens) <= params.max_tokens
        assert all(0 <= t < model.config.vocab_size for t in got.tokens)
        ids = prompt.get("prompt_tokens") or tok.encode(prompt["prompt"])
        if params.greedy or params.seed is not None:  # reproducible: equal to the reference
            assert got.tokens == reference.generate(model, ids, params, block_size=BLOCK)
    canary = _generate(xpair, CANARY_PARAMS, prompt_tokens=CANARY)
    assert canary.tokens == reference.generate(model, CANARY, CANARY_PARAMS, block_size=BLOCK)


def test_the_pair_is_idle_and_alive_after_the_property(xpair):
    poll(lambda: all_free(xpair.client_socket), what="prefill pool all free")
    poll(lambda: all_free(xpair.link_socket), what="decode pool all free")
    assert all(d.proc.poll() is None for d in xpair.daemons.values())
