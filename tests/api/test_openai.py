"""The HTTP API through the official `openai` client against real daemons: text, streaming,
stop strings, usage, metrics, a client that goes away, and 64 concurrent streams."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from common import client
from common.sampling_params import SamplingParams
from tests.support.api import MODEL, Stack, metrics, openai, samples

PROMPT = "The quick brown fox"


async def areference_text(stack: Stack, prompt: str, max_tokens: int) -> str:
    """Greedy text through the raw socket client, as `pdkv generate` gets it."""
    result = await client.generate(
        stack.pair.client_socket,
        prompt=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    return result.text


def reference_text(stack: Stack, prompt: str, max_tokens: int) -> str:
    return asyncio.run(areference_text(stack, prompt, max_tokens))


def test_greedy_completion_equals_pdkv_generate(stack: Stack) -> None:
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdkv.cli",
            "--runtime-dir",
            str(stack.pair.runtime),
            "generate",
            "--no-stream",
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--json",  # the text exactly (plain output escapes control characters)
            PROMPT,
        ],
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        timeout=60,
        check=True,
    )
    expected = json.loads(cli.stdout)["text"]
    out = stack.api.sync_client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 1 + len(PROMPT.encode())  # BOS + bytes
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.model == MODEL and out.object == "text_completion"


def test_streamed_completion_equals_whole(stack: Stack) -> None:
    whole = reference_text(stack, PROMPT, 10)
    chunks = list(
        stack.api.sync_client().completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


async def test_async_chat_streamed_with_usage_equals_whole(stack: Stack) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    api = stack.api.async_client()
    whole = await api.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = [
        c
        async for c in await api.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    ]
    await api.close()
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    prompt = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"  # the default template
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == 1 + len(prompt)
    assert whole.choices[0].message.content == await areference_text(stack, prompt, 8)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_string_cuts_the_text_and_ends_the_request(stack: Stack, stream: bool) -> None:
    full = reference_text(stack, PROMPT, 24)
    stop = full[8:11]  # three characters in the middle of the greedy text
    cut = full[: full.find(stop)]
    api = stack.api.sync_client()
    kw = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=400,
        temperature=0,
        stop=[stop, "\x00never"],
        extra_body={"ignore_eos": True},
    )
    if stream:
        chunks = list(
            api.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        out = api.completions.create(**kw)
        text, reason, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
    assert text == cut
    assert reason == "stop"
    assert usage.prompt_tokens == 1 + len(PROMPT.encode())
    assert len(cut.encode()) <= usage.completion_tokens < 400  # ended at the stop, not max_tokens
    st = stack.wait_idle()
    assert all(s.pool["free"] == s.pool["total"] and s.inflight == 0 for s in st.values())


def test_errors_map_to_openai_errors(stack: Stack) -> None:
    api = stack.api.sync_client()
    cases = [
        (dict(n=17), openai.BadRequestError, "n"),  # over MAX_N
        (dict(temperature=-1), openai.BadRequestError, "temperature"),
        (dict(extra_body={"top_k": -3}), openai.BadRequestError, "top_k"),
        (dict(stop=["a", "b", "c", "d", "e"]), openai.BadRequestError, "stop"),
        (dict(prompt="x" * 300), openai.BadRequestError, "prompt"),  # over --max-prompt-tokens
        (dict(model="gpt-4"), openai.NotFoundError, "model"),
        (dict(logprobs=21), openai.BadRequestError, "logprobs"),  # over 20
    ]
    for extra, error, param in cases:
        kw = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}
        with pytest.raises(error) as info:
            api.completions.create(**kw)
        assert info.value.body["param"] == param, extra
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 5}])
    assert info.value.body["param"].startswith("messages")
    counts = metrics(stack)
    assert counts["pdkv_api_requests_total{endpoint=completions,outcome=bad_request}"] >= 7


def test_client_disconnect_mid_stream_frees_blocks(stack: Stack) -> None:
    api = stack.api.sync_client()
    stream = api.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [next(stream) for _ in range(4)]
    busy = stack.statuses()
    assert busy["decode"].inflight == 1 and busy["decode"].pool["owned"] > 0
    stream.close()  # the HTTP connection goes away mid-stream
    st = stack.wait_idle()
    assert all(s.pool["free"] == s.pool["total"] and s.inflight == 0 for s in st.values())
    assert (
        metrics(stack)["pdkv_api_requests_total{endpoint=completions,outcome=client_disconnect}"]
        >= 1
    )
    # Aborted, not run to its end: the prefill cancelled it and never finished it.
    events = [
        line["event"]
        for line in map(json.loads, stack.pair.daemons["prefill"].log_text().splitlines())
        if line.get("request_id") == chunks[0].id
    ]
    assert "request_cancelled" in events and "request_finished" not in events, events


def test_64_concurrent_streams_leave_no_blocks_or_fds(stack: Stack) -> None:
    prompts = [f"{PROMPT} {i}" for i in range(4)]
    expected = {p: reference_text(stack, p, 12) for p in prompts}
    procs = {"api": psutil.Process(stack.api.proc.pid)}
    procs |= {role: psutil.Process(d.proc.pid) for role, d in stack.pair.daemons.items()}
    fds_before = {role: p.num_fds() for role, p in procs.items()}

    async def one(api: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
        stream = await api.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts, reason = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(parts), reason

    async def burst() -> list[tuple[str, str]]:
        async with stack.api.async_client() as api:
            return await asyncio.gather(*(one(api, prompts[i % 4]) for i in range(64)))

    results = asyncio.run(burst())
    assert [r for r in results if r[1] != "length"] == []
    assert all(text == expected[prompts[i % 4]] for i, (text, _) in enumerate(results))
    st = stack.wait_idle()
    assert all(s.pool["free"] == s.pool["total"] and s.inflight == 0 for s in st.values())
    deadline = time.monotonic() + 15  # the API's side of closed HTTP connections may lag
    while True:
        fds = {r: p.num_fds() for r, p in procs.items()}
        if all(fds[r] <= fds_before[r] for r in fds) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(fds[r] <= fds_before[r] for r in fds), (fds_before, fds)
    m = metrics(stack)
    assert m["pdkv_api_requests_in_flight{}"] == 0
    assert m["pdkv_api_time_to_first_token_seconds_count{}"] >= 64


def test_health_models_and_daemon_metrics(stack: Stack) -> None:
    status, _, body = stack.api.get("/health")
    assert status == 200 and b'"ok"' in body
    assert [m.id for m in stack.api.sync_client().models.list()] == [MODEL]
    m = metrics(stack)
    assert m["pdkv_daemon_up{role=prefill}"] == m["pdkv_daemon_up{role=decode}"] == 1
    assert m["pdkv_link_up{}"] == 1
    assert m["pdkv_link_reconnects_total{}"] == 0
    assert m["pdkv_pool_blocks{role=decode,state=total}"] == 1024
    assert m["pdkv_pool_blocks{role=prefill,state=used}"] == 0
    assert m["pdkv_handoff_seconds_count{}"] >= 1


def test_every_series_names_its_process_as_pdkv_status_does(stack: Stack) -> None:
    """pdkv_instance: each daemon's series carry the name its STATUS (and `pdkv status`)
    reports, ROLE@HOSTNAME:RUNTIME_DIR by default, distinct for the two daemons of one runtime
    dir; the API's own series carry api@HOSTNAME:PORT."""
    st = stack.statuses()
    host = socket.gethostname()
    runtime = stack.pair.runtime
    assert st["prefill"].instance == f"prefill@{host}:{runtime}"
    assert st["decode"].instance == f"decode@{host}:{runtime}"
    got = samples(stack)
    for role in ("prefill", "decode"):
        named = {s.labels["pdkv_instance"] for s in got if s.labels.get("role") == role}
        assert named == {st[role].instance}, (role, named)
    (link,) = [s for s in got if s.name == "pdkv_link_up"]
    assert link.labels["pdkv_instance"] == st["prefill"].instance
    api = {s.labels["pdkv_instance"] for s in got if s.name.startswith("pdkv_api_")}
    assert api == {f"api@{host}:{stack.api.port}"}
    shown = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(runtime), "status"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    for role in ("prefill", "decode"):
        assert f"instance {st[role].instance} " in shown, shown
