"""Logits processing and logprobs (common.model.logits) against transformers and direct formulas,
on real logits of a transformers LlamaForCausalLM and of pdkv's own load of it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common.model import reference
from common.model.loader import load_model
from common.model.logits import TokenHistory, logprobs, process, prompt_logprobs
from common.model.paged import slots_for
from common.model.prefill import prefill_many, split_rows
from common.model.sampling import draw, make_generator
from common.sampling_params import SamplingParams, SamplingParamsError
from tests.support.checkpoints import save_hf_llama

transformers = pytest.importorskip("transformers")

TOL = 1e-4
PROMPTS = [[1, 17, 42, 42, 9, 250, 17], [1, 5, 6], [1, 99, 98, 97, 96, 95, 94, 93, 92, 91]]
GENERATED = [[42, 3, 3, 3], [7], [91, 91, 200]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(transformers' model, pdkv's load of the same checkpoint)."""
    torch.set_num_threads(1)
    path: Path = tmp_path_factory.mktemp("hf")
    hf = save_hf_llama(path)
    ours, _ = load_model(path, allow_byte_tokenizer=True)
    return hf, ours


def hf_logits(hf, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def real_rows(hf) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[3, vocab]: transformers' logits of each prompt + generated's next token."""
    return torch.stack([hf_logits(hf, p + g)[-1] for p, g in zip(PROMPTS, GENERATED, strict=True)])


def histories(params: list[SamplingParams], vocab: int) -> list[TokenHistory]:
    return [
        TokenHistory.start(p, g, vocab, torch.device("cpu"))
        for p, g, _ in zip(PROMPTS, GENERATED, params, strict=True)
    ]


def test_repetition_penalty_equals_transformers_processor(models) -> None:  # type: ignore[no-untyped-def]
    hf, _ = models
    logits = real_rows(hf)
    penalties = [1.3, 0.7, 2.0]  # one batch, a penalty per row (below 1 rewards repeats)
    params = [SamplingParams(repetition_penalty=r) for r in penalties]
    ours = process(logits, params, histories(params, logits.shape[-1]), [1, 1, 1], ())
    for b, r in enumerate(penalties):
        proc = transformers.RepetitionPenaltyLogitsProcessor(penalty=r)
        ids = torch.tensor([PROMPTS[b] + GENERATED[b]])
        theirs = proc(ids, logits[b : b + 1].clone())[0]
        torch.testing.assert_close(ours[b], theirs, rtol=0, atol=1e-6)
        assert not torch.equal(ours[b], logits[b])


def test_presence_and_frequency_penalties_equal_the_formula(models) -> None:  # type: ignore[no-untyped-def]
    hf, _ = models
    logits = real_rows(hf)
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # neutral, in the same batch: untouched
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=1.1),
    ]
    ours = process(logits, params, histories(params, logits.shape[-1]), [1, 1, 1], ())
    for b, p in enumerate(params):
        want = logits[b].clone()
        if p.repetition_penalty != 1.0:  # applied first, over prompt + generated, as vLLM
            proc = transformers.RepetitionPenaltyLogitsProcessor(penalty=p.repetition_penalty)
            want = proc(torch.tensor([PROMPTS[b] + GENERATED[b]]), want[None])[0]
        for token in set(GENERATED[b]):  # OpenAI: over the generated tokens only
            count = GENERATED[b].count(token)
            want[token] -= p.frequency_penalty * count + p.presence_penalty
        torch.testing.assert_close(ours[b], want, rtol=0, atol=1e-6)
    assert torch.equal(ours[1], logits[1])


def test_neutral_parameters_leave_the_logits_as_they_are(models) -> None:  # type: ignore[no-untyped-def]
    logits = real_rows(models[0])
    params = [SamplingParams(min_tokens=1)] * 3
    assert process(logits, params, [None] * 3, [1, 2, 3], {2}) is logits  # min_tokens passed


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached(models) -> None:  # type: ignore[no-untyped-def]
    logits = real_rows(models[0])
    params = [
        SamplingParams(min_tokens=2, stop_token_ids=(42, 7)),
        SamplingParams(min_tokens=2, stop_token_ids=(42,)),
        SamplingParams(stop_token_ids=(42,)),
    ]
    out = process(logits, params, [None] * 3, [1, 2, 0], {2})
    assert out[0, 2] == out[0, 42] == out[0, 7] == -math.inf  # step 1 < 2
    assert torch.equal(out[0, 8:42], logits[0, 8:42])
    assert torch.equal(out[1], logits[1])  # its step 2 reached min_tokens
    assert torch.equal(out[2], logits[2])  # no min_tokens
    tokens, _ = draw(
        torch.where(torch.arange(logits.shape[-1]) == 42, 1e4, logits),  # 42 would win
        params,
        [None] * 3,
        steps=[1, 2, 0],
        histories=[None] * 3,
        eos_ids={2},
    )
    assert tokens[0] != 42 and tokens[1] == 42 and tokens[2] == 42


def test_min_tokens_equals_transformers_min_new_tokens_processor(models) -> None:  # type: ignore[no-untyped-def]
    """EOS and stop_token_ids masked while fewer than min_tokens are generated, as transformers'
    MinNewTokensLengthLogitsProcessor masks its eos ids (over every step on both sides)."""
    logits = real_rows(models[0])[:1]
    prompt = PROMPTS[0]
    for step in range(5):
        params = [SamplingParams(min_tokens=3, stop_token_ids=(42, 17))]
        ours = process(logits, params, [None], [step], {2})
        proc = transformers.MinNewTokensLengthLogitsProcessor(len(prompt), 3, [2, 42, 17])
        ids = torch.tensor([prompt + [5] * step])
        theirs = proc(ids, logits.clone())
        assert torch.equal(ours, theirs), step


def test_draw_logprobs_are_log_softmax_of_the_raw_logits(models) -> None:  # type: ignore[no-untyped-def]
    logits = real_rows(models[0])
    params = [
        SamplingParams(logprobs=5, repetition_penalty=3.0),  # penalized: raw logprobs still
        SamplingParams(),  # asks none
        SamplingParams(logprobs=0, temperature=0.8, seed=3),
    ]
    gens = [make_generator(p, 0) for p in params]
    tokens, lps = draw(
        logits, params, gens, steps=[0] * 3, histories=histories(params, 300), eos_ids=()
    )
    lsm = torch.log_softmax(logits, dim=-1)
    assert lps[1] is None
    for b in (0, 2):
        entry = lps[b]
        assert entry is not None and entry.token == tokens[b]
        assert entry.logprob == pytest.approx(float(lsm[b, tokens[b]]), abs=1e-6)
    top_lp, top_ids = torch.topk(lsm[0], 5)
    assert [t for t, _ in lps[0].top] == top_ids.tolist()
    assert [v for _, v in lps[0].top] == pytest.approx(top_lp.tolist(), abs=1e-6)
    assert lps[2].top == []
    floor = logprobs(torch.tensor([[0.0, -math.inf]]), [1], [1])[0]
    assert floor is not None and floor.logprob == -9999.0  # JSON has no -inf


def test_prompt_logprobs_from_the_prefill_equal_transformers(models) -> None:  # type: ignore[no-untyped-def]
    hf, ours = models
    every = [True, False, True]
    kv = ours.new_kv_cache(8, 16)
    mappings = [slots_for([i], 0, len(p), 16) for i, p in enumerate(PROMPTS)]
    out = prefill_many(ours, [torch.tensor(p) for p in PROMPTS], mappings, kv, every_position=every)
    assert out.shape[0] == len(PROMPTS[0]) + 1 + len(PROMPTS[2])  # only where asked
    last, full = split_rows(out, [len(p) for p in PROMPTS], every)
    assert full[1] is None
    for b, prompt in enumerate(PROMPTS):
        theirs = hf_logits(hf, prompt)
        scale = float(theirs.abs().max())
        torch.testing.assert_close(last[b], theirs[-1], rtol=0, atol=TOL * scale)
        if not every[b]:
            continue
        entries = prompt_logprobs(full[b], prompt, 3)
        lsm = torch.log_softmax(theirs, dim=-1)
        assert [e.token for e in entries] == prompt[1:]
        want = [float(lsm[t - 1, prompt[t]]) for t in range(1, len(prompt))]
        assert [e.logprob for e in entries] == pytest.approx(want, abs=TOL * scale)
        for t, e in enumerate(entries):
            assert [i for i, _ in e.top] == torch.topk(lsm[t], 3).indices.tolist()


def test_the_reference_with_penalties_is_batch_independent(models) -> None:  # type: ignore[no-untyped-def]
    _, ours = models
    params = [
        SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=0.05),
        SamplingParams(max_tokens=8, ignore_eos=True),
        SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=-2),
    ]
    together = reference.generate_batch(ours, PROMPTS, params)
    alone = [reference.generate(ours, p, s) for p, s in zip(PROMPTS, params, strict=True)]
    assert together == alone
    plain = reference.generate_batch(ours, PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert together[1] == plain[1]  # neutral parameters: greedy as ever
    assert together[0] != plain[0] and together[2] != plain[2]  # the penalties changed them


def test_sampling_params_ranges() -> None:
    for bad in (
        SamplingParams(logprobs=21),
        SamplingParams(prompt_logprobs=-1),
        SamplingParams(presence_penalty=2.1),
        SamplingParams(frequency_penalty=float("nan")),
        SamplingParams(repetition_penalty=0.0),
        SamplingParams(min_tokens=-1),
        SamplingParams(stop_token_ids=tuple(range(65))),
        SamplingParams(max_tokens=0),  # only with prompt_logprobs
    ):
        with pytest.raises(SamplingParamsError):
            bad.validate()
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).validate().max_tokens == 0
