"""`pdkv generate` as a user runs it (a subprocess against a real pair): --json, a prompt from
standard input, no control bytes on the terminal, no traceback when the prefill dies mid-stream."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import torch

from common import client
from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from tests.support.daemons import Pair

CONTROL = {chr(c) for c in [*range(32), 127, *range(0x80, 0xA0)]} - {"\n", "\t"}


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    return load_model(None)


def _generate(
    pair: Pair, *args: str, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(pair.runtime), "generate"]
    return subprocess.run(
        [*argv, *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )


def test_json_from_stdin_has_ids_text_reason_and_timings(pair: Pair, tiny) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny
    prompt = "Once upon a time\nthere was a cache"
    proc = _generate(pair, "-", "--json", "--max-tokens", "40", "--ignore-eos", stdin=prompt)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.isascii()  # no raw control character, C1 included, reaches a terminal
    out = json.loads(proc.stdout)
    expected = reference.generate(
        model, tok.encode(prompt), SamplingParams(max_tokens=40, ignore_eos=True), block_size=16
    )
    assert out["tokens"] == expected  # the whole prompt came through stdin, newline included
    assert out["text"] == tok.decode(expected)  # exact, control characters and all
    assert out["finish_reason"] == "length" and out["request_id"]
    n = len(tok.encode(prompt))
    assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 40, "cached_tokens": 0}
    t = out["timings"]
    assert t["ttft_ms"] > 0 and t["handoff_us"] > 0 and t["total_ms"] >= t["ttft_ms"]
    assert out["decode"].endswith("@" + pair.link_socket)  # the decode it was handed to
    args = ("-", "--json", "--max-tokens", "40", "--ignore-eos")
    again = json.loads(_generate(pair, *args, stdin=prompt).stdout)
    assert again["usage"]["cached_tokens"] == (n - 1) // 16 * 16 > 0  # from the prefix cache
    assert again["tokens"] == expected


def test_plain_output_escapes_control_characters(pair: Pair) -> None:
    args = ["--max-tokens", "64", "--ignore-eos"]
    raw = json.loads(_generate(pair, "Hello", "--json", *args).stdout)["text"]
    assert CONTROL & set(raw), "the tiny model's text has no control character to escape"
    for mode in ("--stream", "--no-stream"):
        proc = _generate(pair, "Hello", mode, *args)
        assert proc.returncode == 0, proc.stderr
        assert not CONTROL & set(proc.stdout), repr(proc.stdout)
        assert "\\x" in proc.stdout


def test_empty_prompt_and_no_prompt(pair: Pair) -> None:
    proc = _generate(pair, "")
    assert proc.returncode == 1 and "BAD_REQUEST" in proc.stderr and "empty" in proc.stderr
    proc = _generate(pair)
    assert proc.returncode == 2 and "PROMPT" in proc.stderr


def test_prefill_dying_mid_stream_is_a_message_not_a_traceback(pair: Pair) -> None:
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(pair.runtime), "generate"]
    gen = subprocess.Popen(
        [*argv, "a long one", "--max-tokens", "8000", "--ignore-eos"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert gen.stdout is not None and gen.stdout.read(1), "nothing streamed"
        pair.daemons["prefill"].proc.kill()
        _, err = gen.communicate(timeout=60)
    finally:
        gen.kill()
    text = err.decode(errors="replace")
    assert gen.returncode == 1, text
    assert "Traceback" not in text, text
    assert "closed the connection" in text, text


def test_decode_down_fails_at_once_with_the_apis_reason(pair: Pair) -> None:
    """The decode restarting (stopped, its link down): `pdkv generate` refuses in seconds, as the
    API's 503 does, instead of waiting the prefill's --handoff-timeout (30 s) for it."""
    pair.daemons["decode"].stop()
    deadline = time.monotonic() + 30
    while asyncio.run(client.status(pair.client_socket)).links[0]["state"] == "up":
        assert time.monotonic() < deadline, "the link stayed up"
        time.sleep(0.05)
    started = time.monotonic()
    proc = _generate(pair, "hello", "--json", timeout=25)
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout + proc.stderr
    error = json.loads(proc.stdout)["error"]
    assert error["code"] == "LINK_DOWN", error
    assert "link to the decode daemon is down" in error["message"], error
    assert took < 10, f"took {took:.1f} s"
    plain = _generate(pair, "hello", timeout=25)
    assert plain.returncode == 1 and "link to the decode daemon is down" in plain.stderr
    assert "Traceback" not in plain.stderr, plain.stderr
