"""`pdkv demo`: the whole system on temporary sockets, checked against the single-process reference.

Starts the decode and prefill daemons as real processes, runs a handful of prompts concurrently
(progress on stderr: redrawn on a terminal, whole lines otherwise), prints a per-request table and
totals, compares every output with the reference generator token for token (in fp32 a token may
part from it where the reference's two best logits tie: "tie"), stops the pair, and
returns 1 on any mismatch.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from common import client
from common.daemon import logs
from common.errors import PdkvError
from common.sampling_params import SamplingParams
from pdkv.progress import Progress

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated serving splits prefill and decode across processes.",
    "KV blocks",
    "Once upon a time, in a land of paged attention and interprocess events, there lived a cache.",
    "pdkv",
    "A prompt of exactly thirty-two b",
    "Sixteen bytes!!!",
]


def _spawn(
    runtime: Path, role: str, device: str, model: str | None, log_level: str
) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "pdkv.cli",
        "--runtime-dir",
        str(runtime),
        "--log-format",
        "json",
        "--log-level",
        log_level,
        role,
        "start",
        "--device",
        device,
    ]
    if model:
        argv += ["--model", model]
    log = open(runtime / f"{role}.log", "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


async def _wait_ready(path: Path, proc: subprocess.Popen, role: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PdkvError(f"{role} daemon exited with {proc.returncode} during start")
        try:
            st = await client.status(str(path), timeout=1.0)
        except (OSError, TimeoutError, PdkvError):
            await asyncio.sleep(0.1)
            continue
        if role == "decode" or (st.links and st.links[0].get("state") == "up"):
            return
        await asyncio.sleep(0.05)
    raise PdkvError(f"{role} daemon not ready within {timeout}s")


async def _run_all(sock: Path, prompts: list[str], params: SamplingParams) -> list[client.Result]:
    progress = Progress(click.get_text_stream("stderr"), len(prompts), "requests finished")

    async def one(i: int, prompt: str) -> client.Result:
        res = await client.generate(
            str(sock), prompt=prompt, sampling=params, request_id=f"demo-{i}"
        )
        progress.advance()
        return res

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        progress.close()


def _reference(
    model_dir: str | None,
    device: str,
    prompts: list[str],
    params: SamplingParams,
    got: list[list[int]],
    block_size: int,
) -> tuple[list[str], list[int]]:
    """Each output's verdict against the single-process reference ("yes", "tie" or "NO") and each
    prompt's length in tokens. In fp32 (CPU) an output that parts from the reference only where
    the reference's two best logits tie (`reference.compare`) is a "tie": the daemons' batch sums
    in another order than the reference's batch of one, and a tie then goes either way."""
    import torch

    from common.daemon.runtime import resolve_device
    from common.model import reference
    from common.model.loader import load_model

    dev = resolve_device(device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    if model_dir is None:
        torch.set_num_threads(1)
    model, tok = load_model(model_dir, device=dev, dtype=dtype)
    ids = [tok.encode(p) for p in prompts]
    verdicts = []
    for prompt, out in zip(ids, got, strict=True):
        if out == reference.generate(model, prompt, params, block_size=block_size):
            verdicts.append("yes")
            continue
        # bf16's rounding is far coarser than compare's fp32 margin: only fp32 ties are told apart
        ok = dtype == torch.float32 and reference.compare(model, prompt, params, out)[0]
        verdicts.append("tie" if ok else "NO")
    return verdicts, [len(x) for x in ids]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_demo(
    *,
    num_prompts: int = 8,
    max_tokens: int = 24,
    device: str = "auto",
    decode_device: str | None = None,
    model: str | None = None,
    log_level: str = "INFO",
) -> int:
    from common.daemon.runtime import resolve_device

    # the reference's model load logs too: keep its lines out of the table (stderr, warnings only)
    logs.configure("auto", "WARNING")
    try:
        device = str(resolve_device(device))  # the banner names the device, not "auto"
    except PdkvError as exc:
        click.echo(f"error: {exc}", err=True)
        return 3
    try:
        decode_device = str(resolve_device(decode_device)) if decode_device else device
    except PdkvError as exc:
        click.echo(f"error: --decode-device: {exc}", err=True)
        return 3
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    runtime = Path(tempfile.mkdtemp(prefix="pdkv-demo-"))
    os.chmod(runtime, 0o700)
    where = device if decode_device == device else f"prefill {device}, decode {decode_device}"
    click.echo(f"pdkv demo: starting decode + prefill (device {where}) in {runtime}", err=True)
    if model is None:
        click.echo(
            "  model: the built-in tiny model, random weights: its text is noise; what counts is\n"
            "  that every token equals the single-process reference's (column 'match')",
            err=True,
        )
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["decode"] = _spawn(runtime, "decode", decode_device, model, log_level)
        procs["prefill"] = _spawn(runtime, "prefill", device, model, log_level)
        asyncio.run(_wait_ready(runtime / "decode.sock", procs["decode"], "decode"))
        asyncio.run(_wait_ready(runtime / "prefill.sock", procs["prefill"], "prefill"))
        click.echo(f"  daemons up; running {num_prompts} prompts concurrently", err=True)
        t0 = time.monotonic()
        results = asyncio.run(_run_all(runtime / "prefill.sock", prompts, params))
        wall = time.monotonic() - t0
        click.echo("  computing the single-process reference", err=True)
        verdicts, prompt_lens = _reference(
            model, device, prompts, params, [r.tokens for r in results], block_size=16
        )
    except (PdkvError, OSError, client.RequestFailed) as exc:
        click.echo(f"error: {exc}", err=True)
        for role in procs:
            click.echo(
                f"--- {role} log ---\n{(runtime / f'{role}.log').read_text(errors='replace')[-3000:]}",
                err=True,
            )
        return 1
    finally:
        _stop(procs)
    code = _report(results, verdicts, prompt_lens, wall)
    if code == 0:
        shutil.rmtree(runtime, ignore_errors=True)
    else:
        click.echo(f"daemon logs kept in {runtime}", err=True)
    return code


def _report(
    results: list[client.Result],
    verdicts: list[str],
    prompt_lens: list[int],
    wall: float,
) -> int:
    header = (
        f"{'request':<9} {'prompt':>6} {'gen':>4} {'ttft ms':>8} {'handoff us':>10}  match  text"
    )
    click.echo(header)
    click.echo("-" * len(header))
    mismatches = 0
    handoffs: list[float] = []
    generated = 0
    for r, verdict, plen in zip(results, verdicts, prompt_lens, strict=True):
        mismatches += verdict == "NO"
        t = r.finish.timings if r.finish else {}
        handoffs.append(t.get("handoff_us", 0.0))
        generated += len(r.tokens)
        text = r.text.replace("\n", " ")[:28]
        click.echo(
            f"{r.request_id:<9} {plen:>6} {len(r.tokens):>4} {t.get('ttft_ms', 0):>8.2f} "
            f"{t.get('handoff_us', 0):>10.1f}  {verdict:>5}  {text!r}"
        )
    click.echo("-" * len(header))
    click.echo(
        f"{len(results)} requests, {generated} tokens in {wall:.2f}s = {generated / wall:.1f} tokens/s; "
        f"handoff p50 {_pct(handoffs, 0.5):.1f} us, p99 {_pct(handoffs, 0.99):.1f} us "
        f"(mean {statistics.fmean(handoffs):.1f})"
    )
    if mismatches:
        click.echo(
            f"FAILED: {mismatches} of {len(results)} outputs differ from the single-process reference"
        )
        return 1
    ties = verdicts.count("tie")
    if ties:
        click.echo(
            f"OK: every output equals the single-process reference, {ties} of them from where the "
            "reference's two best logits tie (either token is right there: 'tie' above)"
        )
        return 0
    click.echo("OK: every output equals the single-process reference token for token")
    return 0


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    for role in ("prefill", "decode"):
        proc = procs.get(role)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
