"""common.structured on its own: the bitmask's one masked pass, the grammar interface over
llguidance (masks, accept, completion, rollback, refusals that name the problem), the LRU cache,
and the sampler drawing under a mask."""

from __future__ import annotations

import json
import math

import pytest
import torch

from common.model.sampling import draw, make_generator
from common.model.tokenizer import ByteTokenizer
from common.sampling_params import SamplingParams, SamplingParamsError, StructuredOutput
from common.structured import GrammarCache, GrammarError, bitmask, cached_grammar, grammars_for
from common.structured.grammar import LlguidanceBackend

VOCAB, EOS = 260, 257


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    return grammars_for(ByteTokenizer(), VOCAB, {EOS})


def _allowed(m, vocab: int = VOCAB) -> list[int]:  # type: ignore[no-untyped-def]
    mask = bitmask.allocate(1, vocab)
    mask.zero_()
    m.fill(mask, 0)
    return bitmask.allowed(mask, vocab)[0].nonzero().flatten().tolist()


def test_allowed_unpacks_bits_in_llguidance_layout() -> None:
    mask = torch.zeros(2, bitmask.words(70), dtype=torch.int32)
    mask[0, 0] = 1 << 5
    mask[0, 2] = 1 << 3  # token 67
    mask[1, 1] = -(1 << 31)  # the sign bit: token 63
    ok = bitmask.allowed(mask, 70)
    assert ok[0].nonzero().flatten().tolist() == [5, 67]
    assert ok[1].nonzero().flatten().tolist() == [63]


def test_apply_masks_only_the_constrained_rows() -> None:
    logits = torch.randn(3, 40)
    mask = torch.zeros(1, bitmask.words(40), dtype=torch.int32)
    mask[0, 0] = (1 << 7) | (1 << 9)
    out = bitmask.apply(logits, [1], mask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [7, 9]
    assert torch.equal(out[1, [7, 9]], logits[1, [7, 9]])
    assert bitmask.apply(logits, [], mask) is logits  # nothing constrained: no work


def test_json_schema_matcher_masks_accepts_and_completes(cache: GrammarCache) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    m = cache.compile(StructuredOutput("json_schema", json.dumps(schema))).matcher()
    assert _allowed(m) == [ord("{")]
    assert not cache.compile(StructuredOutput("json_object")).matcher().accept(ord("["))
    for t in b'{"a": "':
        assert m.accept(t), chr(t)
    assert _allowed(m) == [ord("x"), ord("y")]
    m.rollback(2)
    assert _allowed(m) == [ord(" ")]  # after ':' the layout is json.dumps's
    for t in b' "y"}':
        assert m.accept(t)
    assert m.terminated and _allowed(m) == [EOS]


def test_choice_and_regex(cache: GrammarCache) -> None:
    m = cache.compile(StructuredOutput("choice", json.dumps(["ab", "ac"]))).matcher()
    assert _allowed(m) == [ord("a")]
    assert m.accept(ord("a")) and _allowed(m) == [ord("b"), ord("c")]
    assert m.accept(ord("c")) and m.terminated
    r = cache.compile(StructuredOutput("regex", "[0-2]+")).matcher()
    assert _allowed(r) == [ord("0"), ord("1"), ord("2")]
    assert r.accept(ord("1")) and not r.terminated  # more digits or the end may follow
    assert EOS in _allowed(r)


@pytest.mark.parametrize(
    ("kind", "spec", "says"),
    [
        ("json_schema", "{oops", "json_schema does not compile"),
        ("json_schema", json.dumps({"type": "nonsense"}), "nonsense"),
        ("regex", "(", "regex"),
        ("choice", "not a list", "choice does not compile"),
        ("grammar", "start: missing", "missing"),
    ],
)
def test_specs_that_do_not_compile_name_the_problem(
    cache: GrammarCache, kind: str, spec: str, says: str
) -> None:
    with pytest.raises(GrammarError, match=says):
        cache.compile(StructuredOutput(kind, spec))


def test_cache_is_an_lru_that_counts_compiles() -> None:
    c = GrammarCache(LlguidanceBackend(None, VOCAB, [EOS]), capacity=2)
    specs = [StructuredOutput("regex", f"a{{{i}}}") for i in (1, 2, 3)]
    first = c.compile(specs[0])
    assert c.compile(specs[0]) is first and (c.compiles, c.hits) == (1, 1)
    c.compile(specs[1])
    c.compile(specs[2])  # evicts specs[0], the least recently used
    assert len(c) == 2 and c.compile(specs[0]) is not first and c.compiles == 4
    with pytest.raises(GrammarError):
        c.compile(StructuredOutput("regex", "("))
    assert c.compiles == 5 and len(c) == 2 and c.compile_s > 0


def test_grammars_for_is_one_cache_per_tokenizer() -> None:
    tok = ByteTokenizer()
    assert grammars_for(tok, VOCAB, {EOS}) is grammars_for(tok, VOCAB, frozenset({EOS}))
    assert grammars_for(tok, VOCAB, {EOS}) is not grammars_for(ByteTokenizer(), VOCAB, {EOS})


def test_what_a_loop_may_ask_finds_and_never_compiles() -> None:
    """cached / cached_grammar (asked on an event loop before compiling off it): None for a
    cache not built yet and for a grammar not compiled yet, the compiled one after; neither
    builds a cache nor compiles."""
    tok, spec = ByteTokenizer(), StructuredOutput("regex", "loop[0-9]")
    assert cached_grammar(tok, VOCAB, {EOS}, spec) is None  # no cache for this tokenizer yet
    cache = grammars_for(tok, VOCAB, {EOS})
    assert cached_grammar(tok, VOCAB, {EOS}, spec) is None and cache.compiles == 0
    compiled = cache.compile(spec)
    assert cached_grammar(tok, VOCAB, frozenset({EOS}), spec) is compiled
    assert cache.cached(StructuredOutput("regex", "other")) is None
    assert (cache.compiles, cache.hits) == (1, 1)


def test_draw_under_a_mask_greedy_and_sampled(cache: GrammarCache) -> None:
    """Greedy takes the best allowed token, not the argmax; sampling never draws a masked one;
    the unconstrained row is untouched; logprobs are of the raw logits."""
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    m = cache.compile(StructuredOutput("regex", "[a-d]")).matcher()
    mask = bitmask.allocate(2, VOCAB)
    mask.zero_()
    m.fill(mask, 0)
    m.fill(mask, 1)
    greedy = SamplingParams(max_tokens=4, logprobs=1)
    hot = SamplingParams(max_tokens=4, temperature=5.0, seed=1)
    params = [greedy, hot, greedy]
    allowed = [ord(c) for c in "abcd"]
    for step in range(30):
        gens = [make_generator(p, step) for p in params]
        out, lps = draw(
            logits,
            params,
            gens,
            steps=[step] * 3,
            histories=[None] * 3,
            eos_ids={EOS},
            masks=([0, 1], mask[:2]),
        )
        assert out[0] == allowed[int(torch.argmax(logits[0, allowed]))]
        assert out[1] in allowed
        assert out[2] == int(torch.argmax(logits[2]))
        lsm = torch.log_softmax(logits[0], -1)
        assert lps[0] is not None and math.isclose(lps[0].logprob, float(lsm[out[0]]), abs_tol=1e-5)


@pytest.mark.parametrize(
    ("kind", "spec", "says"),
    [
        ("xml", "<a/>", "structured.kind must be one of"),
        ("json_object", "{}", 'must be "" for kind json_object'),
        ("json_schema", "", "must not be empty for kind json_schema"),
        ("regex", "", "must not be empty for kind regex"),
    ],
)
def test_the_contract_refuses_a_malformed_constraint(kind: str, spec: str, says: str) -> None:
    params = SamplingParams(structured=StructuredOutput(kind, spec))
    with pytest.raises(SamplingParamsError, match=says):
        params.validate()
