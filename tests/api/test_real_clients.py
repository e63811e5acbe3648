"""What real clients met (issue 25), through the official `openai` client against real daemons
serving a real checkpoint directory: the model's context length, every `prompt` form, the
model learned from the daemons, the body limit, refused fields, JSON 404/405, and the CLI's
small ones."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from common import client
from common.sampling_params import SamplingParams
from tests.support.api import Stack, openai, short_runtime, start_api
from tests.support.checkpoints import write_checkpoint
from tests.support.daemons import Pair

MAX_POSITIONS = 64
PROMPTS = ["the quick brown fox", "a lazy dog sleeps", "over the warm sun and then"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "wordy", max_positions=MAX_POSITIONS)


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory, ckpt: Path) -> Iterator[Stack]:
    """Both daemons on the checkpoint; the API started without --model (it follows them)."""
    pair = Pair(short_runtime(tmp_path_factory))
    pair.extra = {role: ["--model", str(ckpt)] for role in ("decode", "prefill")}
    try:
        pair.start("decode")
        pair.start("prefill")
        api = start_api(pair.runtime)
        yield Stack(pair, api)
        assert api.stop() == 0
    finally:
        pair.kill_all()


def cli(runtime: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(runtime), *args]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120)


def reference(stack: Stack, max_tokens: int, **prompt: object) -> tuple[str, int]:
    """(text, prompt tokens) of one greedy request straight to the prefill's socket."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    res = asyncio.run(client.generate(stack.pair.client_socket, sampling=params, **prompt))
    assert res.finish is not None
    return res.text, res.finish.usage.prompt_tokens


def test_the_api_serves_the_daemons_model_under_one_name(real: Stack, ckpt: Path) -> None:
    api = real.api.sync_client()
    assert [m.id for m in api.models.list()] == ["wordy"]
    assert api.models.retrieve("wordy").id == "wordy"
    with pytest.raises(openai.NotFoundError) as info:
        api.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    status = cli(real.pair.runtime, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    lines = status.stdout.splitlines()
    assert all(" model wordy " in line for line in lines[:2]), lines
    assert lines[2] == f"api      up    pid {real.api.proc.pid}  {real.api.url}/v1", lines
    card = json.loads(cli(real.pair.runtime, "status", "--json").stdout)["prefill"]["model_card"]
    assert card == {"name": "wordy", "path": str(ckpt.resolve()), "max_positions": MAX_POSITIONS}


def test_context_length_is_refused_by_the_api_the_daemons_and_pdkv_generate(real: Stack) -> None:
    api = real.api.sync_client()
    ids = [1] + [5] * 59  # 60 tokens
    cases = [  # request fields, the param blamed
        (dict(prompt=ids, max_tokens=5), "max_tokens"),  # 65: checked by the API
        (dict(prompt=" ".join(["fox"] * 70), max_tokens=2), "prompt"),  # counted by the daemon
        (dict(prompt="the fox", max_tokens=62), "max_tokens"),  # 3 + 62: the daemon
        (dict(prompt="the fox", max_tokens=10**9), "max_tokens"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            api.completions.create(model="wordy", **fields)
        assert info.value.body["code"] == "context_length_exceeded", fields
        assert info.value.body["param"] == param, fields
        assert f"{MAX_POSITIONS} tokens" in info.value.body["message"], info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model="wordy", messages=[{"role": "user", "content": "fox"}], max_completion_tokens=64
        )
    assert info.value.body["param"] == "max_completion_tokens"
    fits = api.completions.create(
        model="wordy", prompt=ids, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert fits.usage.completion_tokens == 4  # 60 + 4 = 64: exactly the context
    with pytest.raises(client.RequestFailed) as failed:  # the daemons' own GENERATE
        reference(real, 5, prompt_tokens=ids)
    assert failed.value.code == "BAD_REQUEST" and "64 tokens" in failed.value.reason
    gen = cli(real.pair.runtime, "generate", "the fox", "--max-tokens", "100")
    assert gen.returncode == 1 and "BAD_REQUEST" in gen.stderr, gen.stderr
    assert "context length of 64 tokens" in gen.stderr, gen.stderr
    assert all(s.pool["free"] == s.pool["total"] for s in real.wait_idle().values())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_every_prompt_form_gives_one_choice_per_prompt(real: Stack, stream: bool) -> None:
    tokens = [[1, 3, 4], [1, 7, 8, 9, 10], [1, 11]]
    forms = [  # prompt, what each choice must equal (straight through the socket)
        (PROMPTS[0], [{"prompt": PROMPTS[0]}]),
        (PROMPTS, [{"prompt": p} for p in PROMPTS]),
        (tokens[1], [{"prompt_tokens": tokens[1]}]),
        (tokens, [{"prompt_tokens": t} for t in tokens]),
    ]
    api = real.api.sync_client()
    for prompt, singles in forms:
        expected = [reference(real, 6, **s) for s in singles]
        kw = dict(model="wordy", prompt=prompt, max_tokens=6, temperature=0)
        kw["extra_body"] = {"ignore_eos": True}
        if stream:
            texts: dict[int, str] = defaultdict(str)
            reasons: dict[int, list[str]] = defaultdict(list)
            chunks = list(
                api.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
            )
            for chunk in chunks:
                for c in chunk.choices:
                    texts[c.index] += c.text
                    if c.finish_reason:
                        reasons[c.index].append(c.finish_reason)
            got = [texts[i] for i in range(len(texts))]
            assert dict(reasons) == {i: ["length"] for i in range(len(expected))}
            usage = chunks[-1].usage
        else:
            out = api.completions.create(**kw)
            assert [c.index for c in out.choices] == list(range(len(expected)))
            assert {c.finish_reason for c in out.choices} == {"length"}
            got, usage = [c.text for c in out.choices], out.usage
        assert got == [text for text, _ in expected], prompt
        assert usage.prompt_tokens == sum(n for _, n in expected), prompt
        assert usage.completion_tokens == 6 * len(expected)
    assert all(s.pool["free"] == s.pool["total"] for s in real.wait_idle().values())


def test_a_body_over_the_limit_is_413_naming_it(real: Stack) -> None:
    api = real.api.sync_client()
    with pytest.raises(openai.APIStatusError) as info:
        api.completions.create(model="wordy", prompt="fox " * 3_000_000, max_tokens=1)
    assert info.value.status_code == 413
    assert info.value.body["code"] == "request_too_large"
    assert "2097152 bytes" in info.value.body["message"]
    assert "retry-after" not in info.value.response.headers


def test_fields_that_would_change_the_output_are_refused_not_ignored(real: Stack) -> None:
    api = real.api.sync_client()
    base = dict(model="wordy", max_tokens=2)
    refused = [  # a call, the param named
        (lambda: api.completions.create(prompt="fox", best_of=2, **base), "best_of"),
        (lambda: api.completions.create(prompt="fox", suffix="dog", **base), "suffix"),
        (lambda: api.completions.create(prompt="fox", logit_bias={"5": 3}, **base), "logit_bias"),
        (
            lambda: api.chat.completions.create(
                messages=[{"role": "wizard", "content": "fox"}], **base
            ),
            "messages[0].role",
        ),
    ]
    for call, param in refused:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["param"] == param
        assert info.value.body["code"] == "unsupported_parameter"
    neutral = api.chat.completions.create(
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "fox"}],
        presence_penalty=0,
        frequency_penalty=0,
        response_format={"type": "text"},
        **base,
    )
    assert neutral.choices[0].finish_reason in ("stop", "length")


def test_unknown_paths_and_methods_answer_openai_error_json(real: Stack) -> None:
    for path, status, code in (
        ("/v1/nothing", 404, "not_found"),
        ("/v1/completions", 405, "method_not_allowed"),  # a GET
    ):
        got, headers, body = real.api.get(path)
        error = json.loads(body)["error"]
        assert got == status and headers["content-type"] == "application/json"
        assert error["code"] == code and error["type"] == "invalid_request_error"
        assert "param" not in error  # no field is at fault
    assert "POST" in real.api.get("/v1/completions")[1]["allow"]


def test_a_down_link_fails_at_once_with_its_reason(tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    pair = Pair(short_runtime(tmp_path_factory))
    try:
        pair.start("decode")
        pair.start("prefill", "--handoff-timeout", "3600")  # waiting it out would time out below
        api = start_api(pair.runtime)
        pair.daemons["decode"].stop()
        while asyncio.run(client.status(pair.client_socket)).links[0]["state"] == "up":
            time.sleep(0.05)  # until the prefill sees the decode's socket close
        quick = openai.OpenAI(base_url=api.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with quick, pytest.raises(openai.InternalServerError) as info:
            quick.completions.create(model="pdkv-tiny", prompt="hi", max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "link_down"
        assert "link to the decode daemon is down" in info.value.body["message"]
        assert info.value.response.headers["retry-after"] == "1"
        assert "request_failed" not in pair.daemons["prefill"].log_text()  # never reached it
        assert api.stop() == 0
    finally:
        pair.kill_all()


def test_another_model_than_model_is_refused_at_start_and_later(
    tmp_path_factory: pytest.TempPathFactory, ckpt: Path
) -> None:
    pair = Pair(short_runtime(tmp_path_factory))
    try:
        api = start_api(pair.runtime, "--model", str(ckpt))  # the daemons are not up yet
        pair.start("decode")
        pair.start("prefill")  # the tiny model, not --model
        with pytest.raises(openai.InternalServerError) as info:
            api.sync_client().completions.create(model="wordy", prompt="hi", max_tokens=2)
        assert info.value.body["code"] == "model_mismatch"
        assert f"not --model {ckpt}" in info.value.body["message"]
        status, _, body = api.get("/health")
        assert status == 503 and b"built-in tiny model" in body
        assert api.stop() == 0
        again = cli(pair.runtime, "api", "start", "--model", str(ckpt), "--port", "0")
        assert again.returncode == 3, again.stdout + again.stderr
        assert again.stderr.count("\n") == 1 and "not --model" in again.stderr, again.stderr
    finally:
        pair.kill_all()


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_start(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    big = write_checkpoint(tmp_path / "big", vocab_size=32, tokenizer_words=40)  # 43 ids
    runtime = short_runtime(tmp_path_factory)
    proc = cli(runtime, "decode", "start", "--model", str(big), "--device", "cpu")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "43 tokens, more than the model's vocabulary of 32" in proc.stderr, proc.stderr


def test_cli_small_ones(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    runtime = short_runtime(tmp_path_factory)
    status = cli(runtime, "status")
    assert status.returncode == 1
    assert "FileNotFoundError" not in status.stdout and "not running" in status.stdout
    (tmp_path / "p.txt").write_text("from a file")
    both = cli(runtime, "generate", "a prompt", "--prompt-file", str(tmp_path / "p.txt"))
    assert both.returncode == 2 and "not both" in both.stderr
    assert "no WHICH: all" in cli(runtime, "stop", "--help").stdout
    blank = start_api(runtime, api_key="  ")  # PDKV_API_KEY set but blank: no key
    try:
        with openai.OpenAI(base_url=blank.url + "/v1", api_key="any", max_retries=0) as api:
            assert api.models.list().data == []  # answered (no daemons): the key was not asked
    finally:
        assert blank.stop() == 0
