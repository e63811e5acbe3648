"""Structured output on the real checkpoint (issue 42): with greedy decoding and a JSON schema,
the tokens through both daemons equal transformers' `generate` with llguidance's token masks as
its logits processor (built here from the library itself and transformers' tokenizer, not from
pdkv's wrapper, which differs from it only where a text contains an added token's name:
SmolLM2's added tokens are all special, and then each token's bytes and specialness are the
same, asserted here; tests/structured/test_added_tokens.py for the rest), and every answer
parses and validates against its schema (`jsonschema`).
The schemas go through one daemon pair as one batch. Through the API on the same pair, the
openai client's `parse` turns the model's answer into a Pydantic object."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.torch
import pydantic
import pytest
import torch

from common import client
from common.sampling_params import SamplingParams, StructuredOutput
from common.structured.grammar import JSON_LAYOUT, _added, _from_json
from tests.support.api import start_api
from tests.support.daemons import Pair, all_free
from tests.support.schemas import SCHEMAS
from tests.support.smollm2 import smollm2_dir
from tests.support.structured import validate_json

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # a 135M model on CPU: about a minute
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return smollm2_dir()


@pytest.fixture(scope="module")
def hf(checkpoint: Path):  # type: ignore[no-untyped-def]
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    vocab, eos = model.config.vocab_size, [model.config.eos_token_id]
    _same_view(tok, vocab, eos)
    return model.eval(), tok, llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)


def _same_view(tok, vocab: int, eos: list[int]) -> None:  # type: ignore[no-untyped-def]
    """pdkv's view of the tokenizer (common.structured.grammar) has each token's bytes and
    specialness as the oracle's (llguidance.hf.from_tokenizer's)."""
    text = tok.backend_tokenizer.to_str()
    ours = _from_json(llguidance, text, vocab, eos)
    theirs = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
    assert not _added(text)[1]  # every added token special
    for i in range(vocab):
        assert ours.decode_bytes([i]) == theirs.decode_bytes([i]), i
        assert ours.is_special_token(i) == theirs.is_special_token(i), i


@pytest.fixture(scope="module")
def pair(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    runtime = tmp_path_factory.mktemp("grammar", numbered=True)
    runtime.chmod(0o700)
    args = ["--model", str(checkpoint), "--dtype", "float32"]
    pair = Pair(runtime, extra={"decode": args, "prefill": args})
    try:
        pair.start("decode")
        pair.start("prefill")
        yield pair
    finally:
        pair.kill_all()


def prompt_ids(tok, schema: dict) -> list[int]:  # type: ignore[no-untyped-def]
    ask = f"Answer with one JSON value that matches this JSON schema: {json.dumps(schema)}"
    messages = [{"role": "user", "content": ask}]
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


class _Masks(transformers.LogitsProcessor):
    """llguidance's mask for the one sequence of a generate call, as its logits processor."""

    def __init__(self, matcher, prompt_len: int, vocab: int) -> None:  # type: ignore[no-untyped-def]
        self.m, self.start, self.seen = matcher, prompt_len, 0
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        new = input_ids[0, self.start :].tolist()
        for t in new[self.seen :]:
            assert self.m.consume_token(t), self.m.get_error()
        self.seen = len(new)
        llguidance.torch.fill_next_token_bitmask(self.m, self.mask, 0)
        llguidance.torch.apply_token_bitmask_inplace(scores, self.mask)
        return scores


class _Complete(transformers.StoppingCriteria):
    """Stop once the grammar's text is complete (as the daemons end such a sequence)."""

    def __init__(self, masks: _Masks) -> None:
        self.masks = masks

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
        new = input_ids[0, self.masks.start :].tolist()
        m = self.masks.m.deep_copy()
        done = all(m.consume_token(t) for t in new[self.masks.seen :]) and m.is_stopped()
        return torch.tensor([done])


def hf_constrained(hf, ids: list[int], schema: dict) -> list[int]:  # type: ignore[no-untyped-def]
    model, _, lltok = hf
    vocab = model.config.vocab_size
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults=JSON_LAYOUT
    )
    masks = _Masks(llguidance.LLMatcher(lltok, grammar, log_level=0), len(ids), vocab)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([masks]),
            stopping_criteria=transformers.StoppingCriteriaList([_Complete(masks)]),
        )
    return out[0, len(ids) :].tolist()


def test_greedy_schemas_equal_transformers_and_validate(pair: Pair, hf) -> None:  # type: ignore[no-untyped-def]
    assert len(SCHEMAS) >= 20
    prompts = [prompt_ids(hf[1], s) for s in SCHEMAS]

    async def run() -> list[client.Result]:
        return await asyncio.gather(
            *(
                client.generate(
                    pair.client_socket,
                    prompt_tokens=p,
                    sampling=SamplingParams(
                        max_tokens=MAX_TOKENS,
                        structured=StructuredOutput("json_schema", json.dumps(s)),
                    ),
                )
                for p, s in zip(prompts, SCHEMAS, strict=True)
            )
        )

    results = asyncio.run(run())
    for i, (schema, ids, res) in enumerate(zip(SCHEMAS, prompts, results, strict=True)):
        assert res.finish is not None and res.finish.reason == "stop", (i, res.text)
        validate_json(res.text, schema)  # numbers as Decimal: multipleOf 0.01 exact
        assert res.tokens == hf_constrained(hf, ids, schema), (i, res.text)
    assert all_free(pair.client_socket) and all_free(pair.link_socket)


class Capital(pydantic.BaseModel):
    country: str = pydantic.Field(max_length=24)
    capital: str = pydantic.Field(max_length=24)


def test_openai_parse_with_the_real_model(pair: Pair) -> None:
    api = start_api(pair.runtime)
    try:
        client_ = api.sync_client()
        parse = getattr(client_.chat.completions, "parse", None)
        parse = parse or client_.beta.chat.completions.parse
        done = parse(
            model=smollm2_dir().name,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=60,
            temperature=0,
            response_format=Capital,
        )
        answer = done.choices[0].message.parsed
        assert isinstance(answer, Capital), done.choices[0].message.content
        assert "Paris" in answer.capital, answer  # a real model: it knows
    finally:
        assert api.stop() == 0
