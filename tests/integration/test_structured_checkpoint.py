"""Structured output on a random-weight transformers checkpoint (issue 42's GPU check, run on the
CPU too): greedy tokens under a JSON schema through both daemons equal transformers' `generate`
on the same checkpoint in fp32 with the same grammar library's masks as its logits processor, and
every answer validates. The checkpoint has no tokenizer: the daemons read its ids as bytes
(--allow-byte-tokenizer), and the oracle's grammar is built over the same byte vocabulary."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from common import client
from common.cuda import cuda_available
from common.model.tokenizer import ByteTokenizer
from common.sampling_params import SamplingParams, StructuredOutput
from common.structured import bitmask, grammars_for
from tests.support.checkpoints import save_hf_model
from tests.support.daemons import Pair
from tests.support.schemas import SCHEMAS
from tests.support.structured import (
    CUDA_VARIANTS,
    assert_valid,
    describe,
    first_difference,
    require_grammar_library,
)

transformers = pytest.importorskip("transformers")
SMALL = [SCHEMAS[i] for i in (1, 4, 6, 8, 9, 13, 16, 18, 20, 23)]
#: above the longest answer any of SMALL allows with byte tokens (16 characters of "why" written
#: as \u escapes: 124), so that none ends by length whatever logits a device computes; on the CPU
#: the answers take at most 49 (2026-12-05)
MAX_TOKENS = 160


class _Masks(transformers.LogitsProcessor):
    def __init__(self, matcher, prompt_len: int, vocab: int) -> None:  # type: ignore[no-untyped-def]
        self.m, self.start, self.seen = matcher, prompt_len, 0
        self.mask = bitmask.allocate(1, vocab)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        new = input_ids[0, self.start :].tolist()
        for t in new[self.seen :]:
            assert self.m.accept(t)
        self.seen = len(new)
        self.mask.zero_()
        self.m.fill(self.mask, 0)
        return bitmask.apply(scores, [0], self.mask)


class _Complete(transformers.StoppingCriteria):
    def __init__(self, masks: _Masks) -> None:
        self.masks = masks

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
        last = int(input_ids[0, -1])
        done = self.masks.m.accept(last) and self.masks.m.terminated
        self.masks.m.rollback(1)  # the processor accepts it at the next call
        return torch.tensor([done], device=input_ids.device)


def hf_constrained(model, prompt: list[int], schema: dict, device: str) -> list[int]:  # type: ignore[no-untyped-def]
    vocab = model.config.vocab_size
    grammars = grammars_for(ByteTokenizer(), vocab, {model.config.eos_token_id})
    matcher = grammars.compile(StructuredOutput("json_schema", json.dumps(schema))).matcher()
    masks = _Masks(matcher, len(prompt), vocab)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([masks]),
            stopping_criteria=transformers.StoppingCriteriaList([_Complete(masks)]),
        )
    return out[0, len(prompt) :].tolist()


def schemas_equal_transformers(pair: Pair, model, device: str) -> None:  # type: ignore[no-untyped-def]
    prompts = [[1, *f"answer {i}: ".encode()] for i in range(len(SMALL))]

    async def run() -> list[client.Result | BaseException]:
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
                for p, s in zip(prompts, SMALL, strict=True)
            ),
            return_exceptions=True,
        )

    results = asyncio.run(run())
    assert_valid(results, SMALL, pair, "greedy answers of the random checkpoint")
    wrong = []
    for i, (prompt, schema, res) in enumerate(zip(prompts, SMALL, results, strict=True)):
        assert isinstance(res, client.Result)
        want = hf_constrained(model, prompt, schema, device)
        if res.tokens != want:
            where = first_difference(res.tokens, want)
            margin = _margin_at(model, prompt, schema, res.tokens, want, device)
            wrong.append(f"  #{i} {describe(res)}; {where}; {margin}")
    assert not wrong, "\n".join(["tokens differ from transformers':", *wrong])


def _margin_at(
    model: Any, prompt: list[int], schema: dict, got: list[int], want: list[int], device: str
) -> str:
    """Transformers' masked logits where `got` parts from `want`: its top one and those of both
    tokens, to tell a near-tie (fp32 sums in another order) from a wrong mask or input."""
    k = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if k is None:
        return "one is a prefix of the other"
    vocab = model.config.vocab_size
    grammars = grammars_for(ByteTokenizer(), vocab, {model.config.eos_token_id})
    matcher = grammars.compile(StructuredOutput("json_schema", json.dumps(schema))).matcher()
    for t in want[:k]:
        assert matcher.accept(t)
    mask = bitmask.allocate(1, vocab)
    mask.zero_()
    matcher.fill(mask, 0)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:k]], device=device)).logits[0, -1:].float()
    masked = bitmask.apply(logits, [0], mask)[0]
    return (
        f"transformers' masked logits there: top {float(masked.max()):.6g}, "
        f"got's {float(masked[got[k]]):.6g}, want's {float(masked[want[k]]):.6g}"
    )


def _pair(tmp: Path, ckpt: Path, *args: str) -> Pair:
    common = ["--model", str(ckpt), "--allow-byte-tokenizer", "--dtype", "float32", *args]
    return Pair(tmp, extra={"decode": common, "prefill": common})


#: the daemons' CUDA defaults that run on the CPU (tests/integration/test_structured_daemons.py)
CUDA_DEFAULTS = {
    "decode": ["--overlap-steps", "on", "--prefill-first-ms", "50", "--warm-wait", "on"],
    "prefill": ["--max-prefill-tokens", "16384"],
}


@pytest.mark.parametrize("overlap", ["off", "always", "cuda-defaults"])
def test_random_checkpoint_schemas_equal_transformers_on_cpu(tmp_path_factory, overlap) -> None:  # type: ignore[no-untyped-def]
    """`--overlap-steps always`: the constrained steps are launched ahead too, each one's
    masks filled once the step before is read, before its tokens are carried or read.
    `cuda-defaults`: every CUDA default the CPU can run (`--overlap-steps on` among them)."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    model = save_hf_model(ckpt)
    pair = _pair(tmp_path_factory.mktemp("rt"), ckpt)
    cuda = overlap == "cuda-defaults"
    try:
        pair.start("decode", *(CUDA_DEFAULTS["decode"] if cuda else ["--overlap-steps", overlap]))
        pair.start("prefill", *(CUDA_DEFAULTS["prefill"] if cuda else []))
        schemas_equal_transformers(pair, model, "cpu")
        assert pair.stop_all() == {"prefill": 0, "decode": 0}
        stats = [json.loads(line) for line in pair.daemons["decode"].log_text().splitlines()]
        ran = next(e for e in stats if e.get("event") == "decode_loop_stopped")
        if not cuda:  # with "on", whether a step goes ahead depends on the prefill's timing
            assert (ran["overlapped"] > 0) == (overlap == "always"), ran
    finally:
        pair.kill_all()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)")
@pytest.mark.parametrize("variant", list(CUDA_VARIANTS))
def test_random_checkpoint_schemas_equal_transformers_on_cuda(tmp_path_factory, variant) -> None:  # type: ignore[no-untyped-def]
    """The same with both daemons and transformers on cuda:0, fp32, the daemons' CUDA defaults
    (the decode's steps replay CUDA graphs and go ahead; the masks are filled while the step's
    kernels run), and without each CUDA-only feature in turn (CUDA_VARIANTS). On the CPU the
    top two allowed logits along every answer are at least 1.2 % apart (relative, 2026-12-05):
    a difference here is not a near-tie unless its message shows one."""
    require_grammar_library()
    ckpt = tmp_path_factory.mktemp("ckpt")
    model = save_hf_model(ckpt).to("cuda:0")
    pair = _pair(tmp_path_factory.mktemp("rt"), ckpt, "--device", "cuda:0")
    decode, prefill, env = CUDA_VARIANTS[variant]
    try:
        pair.start("decode", *decode, env=env)
        pair.start("prefill", *prefill, env=env)
        schemas_equal_transformers(pair, model, "cuda:0")
        assert pair.stop_all() == {"prefill": 0, "decode": 0}
    finally:
        pair.kill_all()
