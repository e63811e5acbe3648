"""`pdkv demo`, the README's main command, run as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_runs_the_pair_and_matches_the_reference(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdkv.cli",
            "demo",
            "--prompts",
            "5",
            "--max-tokens",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: every output equals the single-process reference" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("demo-")]
    # "tie": parted from the reference only where its two best logits tie (fp32 summing order)
    assert len(rows) == 5 and all(" yes " in row or " tie " in row for row in rows)
    assert "tokens/s" in proc.stdout and "handoff p50" in proc.stdout
    # the banner names the device --device auto resolved to, and says why the text is noise
    assert re.search(r"\(device (cpu|cuda:\d+)\)", proc.stderr), proc.stderr
    assert "random weights" in proc.stderr
    # stderr is a pipe here: the progress is whole lines, no carriage-return redraws
    assert "\r" not in proc.stderr, repr(proc.stderr)
    assert "  5/5 requests finished\n" in proc.stderr, proc.stderr
    # no log line (the reference's model load) lands in the table on stdout
    assert "model_loaded" not in proc.stdout and "model_loaded" not in proc.stderr
    assert not list(tmp_path.glob("pdkv-demo-*")), "demo left its runtime dir behind"


def test_demo_decode_device_is_checked_apart(tmp_path):
    """--decode-device puts the decode on its own device (two GPUs); one that does not exist
    here is refused in one line, naming that option, before anything starts."""
    argv = [sys.executable, "-m", "pdkv.cli", "demo", "--device", "cpu"]
    proc = subprocess.run(
        [*argv, "--decode-device", "cuda:7", "--prompts", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)},
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: --decode-device: "), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("pdkv-demo-*"))


def test_the_demo_tells_a_tie_from_a_wrong_token(capsys):
    """Its verdicts come from the real reference on the built-in model: the reference's own output
    is "yes", a token no tie explains is "NO" (exit 1), and a "tie" verdict still passes."""
    import torch

    from common.client import Result
    from common.model import reference
    from common.model.loader import load_model
    from common.sampling_params import SamplingParams
    from pdkv import demo

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    model, tok = load_model(None, device=torch.device("cpu"), dtype=torch.float32)
    prompt = demo.PROMPTS[1]
    ids = tok.encode(prompt)
    want = reference.generate(model, ids, params)
    logits = model.forward_dense(torch.tensor(ids + want[:2]))[-1]
    wrong = [*want[:2], int(logits.argmin()), *want[3:]]
    verdicts, lens = demo._reference(None, "cpu", [prompt, prompt], params, [want, wrong], 16)
    assert verdicts == ["yes", "NO"] and lens == [len(ids)] * 2

    results = [Result(f"demo-{i}", tokens=want) for i in range(2)]
    assert demo._report(results, ["yes", "NO"], lens, 1.0) == 1
    assert "FAILED: 1 of 2" in capsys.readouterr().out
    assert demo._report(results, ["yes", "tie"], lens, 1.0) == 0
    out = capsys.readouterr().out
    assert "1 of them from where the reference's two best logits tie" in out
