"""Health as probes see it, on real daemon pairs: `pdkv status` exits 0 only when both daemons are
up and linked; a request while the link is down fails at once with LINK_LOST; probes leave the
logs quiet; status carries the model, dtype, requests served and tokens/s."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from common import client
from common.model.sampling import SamplingParams
from tests.support.daemons import Pair, wait_ready


def _status(pair: Pair, *args: str) -> subprocess.CompletedProcess[str]:
    """`pdkv status` as a probe runs it, with the runtime dir given after the subcommand."""
    argv = [sys.executable, "-m", "pdkv.cli", "status", "--runtime-dir", str(pair.runtime)]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=120)


def test_mismatched_pair_is_unhealthy_and_requests_fail_fast(pair_factory: Pair) -> None:
    pair_factory.start("decode", "--block-size", "16")
    # a handoff timeout far above the client's: waiting it out would end in TimeoutError
    prefill = pair_factory.start(
        "prefill", "--block-size", "32", "--handoff-timeout", "3600", wait=False
    )
    wait_ready(prefill)  # answers, but the decode refuses the link: never linked
    proc = _status(pair_factory)
    assert proc.returncode == 1, proc.stdout
    prefill_line = next(line for line in proc.stdout.splitlines() if line.startswith("prefill"))
    assert prefill_line.startswith("prefill  up ")  # the liveness probes' pattern still holds
    assert "link down" in prefill_line and "INCOMPATIBLE" in prefill_line, prefill_line

    async def first_answer() -> list[object]:
        seen: list[object] = []
        params = SamplingParams(max_tokens=4)
        with pytest.raises(client.RequestFailed) as info:
            async for msg in client.stream(
                pair_factory.client_socket, prompt="hi", sampling=params, timeout=60
            ):
                seen.append(msg)
        assert info.value.code == "LINK_LOST", str(info.value)
        assert "INCOMPATIBLE" in str(info.value), str(info.value)
        return seen

    assert asyncio.run(first_answer()) == [], "a token was computed for an unservable request"
    st = asyncio.run(client.status(pair_factory.client_socket))
    assert st.pool["free"] == st.pool["total"]


def test_healthy_pair_status_exit_0_shows_model_and_throughput(pair: Pair) -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for _ in range(3):
        # 1 + 29 tokens: one full block, cached after the first request and reused by the others
        prompt = "count me, count me, count me."
        asyncio.run(client.generate(pair.client_socket, prompt=prompt, sampling=params))
    proc = _status(pair)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in proc.stdout.splitlines():
        assert "model pdkv-tiny " in line and " float32 " in line, line  # as /v1/models
        assert "served 3" in line and "tokens/s" in line, line
    out = json.loads(_status(pair, "--json").stdout)
    for role in ("prefill", "decode"):
        assert out[role]["served"] == 3 and out[role]["tokens_per_s"] > 0, out[role]
        assert out[role]["dtype"] == "float32"
        assert out[role]["model"].startswith("tiny-seed0-")  # the fingerprint, in --json
        assert out[role]["model_card"]["name"] == "pdkv-tiny"
    for role in ("prefill", "decode"):  # each daemon's own cache: the prefill computed, the
        cache = out[role]["prefix_cache"]  # decode pulled, one block less for each repeat
        assert (cache["queried_tokens"], cache["hit_tokens"]) == (90, 32)
        line = next(line for line in proc.stdout.splitlines() if line.startswith(role))
        assert "prefix cache hit 35.6% of 90 tokens" in line, line


def test_status_probes_do_not_log_on_the_decode(pair: Pair) -> None:
    before = pair.daemons["decode"].log_text()
    for _ in range(5):
        assert _status(pair).returncode == 0
    # a real request afterwards: its lines come later than anything the probes caused
    asyncio.run(client.generate(pair.client_socket, prompt="x", sampling=SamplingParams()))
    new = pair.daemons["decode"].log_text()[len(before) :]
    assert "peer_closed" not in new, new


def test_status_with_nothing_running_exits_1(runtime_dir) -> None:  # type: ignore[no-untyped-def]
    proc = _status(Pair(runtime_dir))
    assert proc.returncode == 1
    assert f"{runtime_dir}/prefill.sock" in proc.stdout, proc.stdout


def test_a_refused_prefill_retrying_is_logged_once_a_minute(pair_factory: Pair) -> None:
    """The mismatched prefill retries every 2 s; the decode warns once for the reason, not per
    attempt (the attempts are counted into the next warning)."""
    decode = pair_factory.start("decode", "--block-size", "16")
    prefill = pair_factory.start("prefill", "--block-size", "32", wait=False)
    wait_ready(prefill)
    deadline = time.monotonic() + 30
    while prefill.log_text().count('"decode_link_down"') < 4:
        assert time.monotonic() < deadline, prefill.log_text()[-2000:]
        time.sleep(0.2)
    refusals = [ln for ln in decode.log_text().splitlines() if '"handshake_refused"' in ln]
    assert len(refusals) == 1, refusals
    assert "INCOMPATIBLE" in refusals[0] and '"not_logged_since": 0' in refusals[0]


def test_a_missing_decode_socket_is_named_in_the_links_last_error(pair_factory: Pair) -> None:
    """The prefill started before its decode: `pdkv status` shows the link's last error with
    the socket it tried, not a bare "[Errno 2] No such file or directory"."""
    prefill = pair_factory.start("prefill", wait=False)
    wait_ready(prefill)
    deadline = time.monotonic() + 30
    while not (link := asyncio.run(client.status(pair_factory.client_socket)).links[0])[
        "last_error"
    ]:
        assert time.monotonic() < deadline, "no connection attempt failed"
        time.sleep(0.05)
    assert "FileNotFoundError" in link["last_error"], link
    assert pair_factory.link_socket in link["last_error"], link
    proc = _status(pair_factory)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("prefill"))
    assert "last error: FileNotFoundError" in line and pair_factory.link_socket in line, line
