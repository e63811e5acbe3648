"""A request the decode loop cannot serve fails alone; a loop that cannot decode at all ends the
daemon (non-zero, logged) instead of leaving it alive and deaf; `pdkv stop` tells the truth.

Real daemons throughout. The per-sequence failure is real too: the decode daemon loads a copy of
the prefill's checkpoint whose embedding row of one token is NaN (same fingerprint: same config,
same file size), so a sequence that feeds that token to the decode gets NaN logits, and no other.
Only the failure of the step itself is injected (tests/support/wrapped_daemon.py): nothing from
outside makes the forward pass raise.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from common import client
from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from common.protocol import ErrorCode
from tests.support.daemons import BLOCK, FaultPair, all_free, new_pair, status
from tests.support.wait import poll

pytest.importorskip("transformers")
from tests.support.checkpoints import save_hf_llama

HOT = SamplingParams(max_tokens=24, temperature=0.7, seed=11, ignore_eos=True)


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def _poisoned_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[FaultPair, int, object]:
    """A pair whose decode's embedding row `bad` is NaN; returns (pair, bad, clean model)."""
    base = Path(tmp_path_factory.mktemp("ckpt", numbered=True))
    clean, poisoned = base / "a" / "ck", base / "b" / "ck"
    save_hf_llama(clean)
    model, _ = load_model(clean, allow_byte_tokenizer=True)
    bad = reference.generate(model, list(range(5, 13)), HOT, block_size=BLOCK)[0]
    poisoned.mkdir(parents=True)
    for f in clean.iterdir():
        (poisoned / f.name).write_bytes(f.read_bytes())
    tensors = load_file(clean / "model.safetensors")
    tensors["model.embed_tokens.weight"][bad] = float("nan")
    save_file(tensors, poisoned / "model.safetensors", metadata={"format": "pt"})
    assert (poisoned / "model.safetensors").stat().st_size == (
        clean / "model.safetensors"
    ).stat().st_size
    pair = new_pair(tmp_path_factory, "nan")
    pair.start("decode", "--model", str(poisoned), "--allow-byte-tokenizer")
    pair.start("prefill", "--model", str(clean), "--allow-byte-tokenizer")
    return pair, bad, model


def test_non_finite_logits_fail_one_request_and_the_batch_goes_on(tmp_path_factory):
    pair, bad, model = _poisoned_pair(tmp_path_factory)
    try:
        # a sequence that never meets the poisoned token, long enough to share steps with it
        for seed in range(40):
            healthy = SamplingParams(max_tokens=48, temperature=0.7, seed=seed, ignore_eos=True)
            prompt = list(range(20, 30))
            want = reference.generate(model, prompt, healthy, block_size=BLOCK)
            if bad not in want:
                break
        else:
            pytest.skip("every healthy candidate meets the poisoned token")

        async def both():  # type: ignore[no-untyped-def]
            sock = pair.client_socket
            ok = asyncio.create_task(
                client.generate(sock, prompt_tokens=prompt, sampling=healthy, timeout=60)
            )
            await asyncio.sleep(0.05)
            with pytest.raises(client.RequestFailed) as failed:
                await client.generate(
                    sock, prompt_tokens=list(range(5, 13)), sampling=HOT, timeout=60
                )
            return failed.value, await ok

        failed, ok = _run(both())
        assert failed.code == ErrorCode.NUMERIC_ERROR, failed
        assert "not finite" in str(failed)
        assert ok.tokens == want  # the batch went on
        again = _run(client.generate(pair.client_socket, prompt_tokens=prompt, sampling=healthy))
        assert again.tokens == want
        poll(lambda: all_free(pair.link_socket), what="decode pool all free")
        assert pair.daemons["decode"].proc.poll() is None
    finally:
        pair.kill_all()


def test_a_failed_decode_step_ends_the_daemon_nonzero_and_answers_the_clients(tmp_path_factory):
    pair = new_pair(tmp_path_factory, "fatal")
    try:
        decode = pair.start(
            "decode", module="tests.support.wrapped_daemon", env={"PDKVTEST_FAIL_STEP": "3"}
        )
        pair.start("prefill")
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        with pytest.raises(client.RequestFailed) as failed:
            _run(client.generate(pair.client_socket, prompt_tokens=[5, 6, 7], sampling=params))
        assert failed.value.code in (ErrorCode.INTERNAL, ErrorCode.LINK_LOST)
        assert decode.proc.wait(timeout=30) == 1  # not alive and deaf
        text = decode.log_text()
        assert "decode_loop_failed" in text and "injected failure" in text
        assert not (pair.runtime / "decode.pid").exists()  # its shutdown ran to the end
        poll(  # what `pdkv status` reports
            lambda: status(pair.client_socket).links[0]["state"] != "up", what="link reported down"
        )
    finally:
        pair.kill_all()


_EXITS_UNCLEAN = r"""
import os, signal, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
signal.signal(signal.SIGTERM, lambda *_: os._exit(1))  # a shutdown that raised: pidfile left
print("ready", flush=True)
time.sleep(60)
"""


def test_stop_reports_a_daemon_that_exits_without_a_clean_shutdown(tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    pidfile = runtime / "decode.pid"
    proc = subprocess.Popen(
        [sys.executable, "-c", _EXITS_UNCLEAN, str(pidfile)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdkv.cli",
                "--runtime-dir",
                str(runtime),
                "stop",
                "decode",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode != 0, out
        assert "without a clean shutdown" in out.stderr
        assert "stopped" not in out.stdout
        assert not pidfile.exists()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 8.9e-38, "top_k": 0, "top_p": 1.0, "seed": 7},
        {"temperature": 5e-324, "seed": 7},
        {"temperature": 0.7, "top_p": 1e-300, "seed": 7},
    ],
    ids=["temp-8.9e-38", "temp-5e-324", "top_p-1e-300"],
)
def test_extreme_sampling_values_from_the_issue_are_served(fault_pair, tiny_model, fields):
    fault_pair.start_both()
    model, tok = tiny_model
    params = SamplingParams(max_tokens=32, ignore_eos=True, **fields)
    got = _run(client.generate(fault_pair.client_socket, prompt="hello", sampling=params))
    assert got.tokens == reference.generate(model, tok.encode("hello"), params, block_size=BLOCK)
    assert len(got.tokens) == 32
    # and the pair still serves: a second request, then an idle pool
    again = _run(client.generate(fault_pair.client_socket, prompt="hello", sampling=params))
    assert again.tokens == got.tokens
    poll(lambda: all_free(fault_pair.link_socket), what="decode pool all free")
    assert status(fault_pair.client_socket).links[0]["state"] == "up"
