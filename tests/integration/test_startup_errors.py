"""A daemon that cannot start says why in one line and exits 3 (systemd's
RestartPreventExitStatus=3): bad --device, --dtype or --model, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.daemon.runtime import ModelRuntime
from decode_server.config import DecodeConfig
from tests.support.checkpoints import save_hf_llama, save_hf_model


def _start(runtime: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(runtime)]
    return subprocess.run(
        [*argv, "decode", "start", *args], capture_output=True, text=True, timeout=120
    )


def _corrupt_checkpoint(path: Path) -> Path:
    save_hf_llama(path)
    (path / "model.safetensors").write_bytes(b"\xff" * 64)  # a header length far too large
    return path


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--device", "gpu"], "--device gpu: expected auto, cpu or cuda:N"),
        (["--device", "cuda:0"], "CUDA is not available"),
        (["--dtype", "int8"], "'int8' is not one pdkv's model runs in"),
        (["--dtype", "foo"], "'foo' is not one pdkv's model runs in"),
        (["--model", "CORRUPT"], "cannot read"),
        (["--model", "NO_TOKENIZER"], "--allow-byte-tokenizer"),
        (["--model", "WINDOW"], "layer_types holds 'chunked_attention'; pdkv computes only"),
        (["--model", "GEMMA"], "architectures is ['GemmaForCausalLM']; pdkv implements only"),
    ],
    ids=[
        "device-gpu",
        "device-cuda",
        "dtype-int8",
        "dtype-foo",
        "corrupt-model",
        "no-tokenizer",
        "unknown-layer-type",
        "unknown-architecture",
    ],
)
def test_bad_setting_exits_3_with_one_clear_line(
    runtime_dir: Path, tmp_path: Path, args: list[str], says: str
) -> None:
    if "CORRUPT" in args:
        args = ["--model", str(_corrupt_checkpoint(tmp_path / "corrupt")), "--device", "cpu"]
    elif "NO_TOKENIZER" in args:
        save_hf_llama(tmp_path / "bare")
        args = ["--model", str(tmp_path / "bare"), "--device", "cpu"]
    elif "WINDOW" in args:  # sliding windows load; an attention kind pdkv lacks does not
        save_hf_model(tmp_path / "qwen3", "qwen3", use_sliding_window=True, sliding_window=16)
        config = tmp_path / "qwen3" / "config.json"
        raw = json.loads(config.read_text())
        config.write_text(json.dumps({**raw, "layer_types": ["chunked_attention"] * 2}))
        args = ["--model", str(tmp_path / "qwen3"), "--device", "cpu", "--allow-byte-tokenizer"]
    elif "GEMMA" in args:
        save_hf_llama(tmp_path / "gemma")
        config = tmp_path / "gemma" / "config.json"
        config.write_text(config.read_text().replace("LlamaForCausalLM", "GemmaForCausalLM"))
        args = ["--model", str(tmp_path / "gemma"), "--device", "cpu", "--allow-byte-tokenizer"]
    elif "--dtype" in args:
        args = [*args, "--device", "cpu"]
    proc = _start(runtime_dir, *args)
    if "cuda:0" in args and proc.returncode == 0:  # pragma: no cover - a GPU host
        pytest.skip("CUDA works here")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_short_dtype_names_load_as_their_long_names(runtime_dir: Path) -> None:
    """`--dtype bf16` (which the loader always accepted) runs, and fingerprints like bfloat16."""
    rts = [
        ModelRuntime.load(
            DecodeConfig(runtime_dir=runtime_dir, device="cpu", dtype=name, num_blocks=2), "decode"
        )
        for name in ("bf16", "bfloat16")
    ]
    try:
        assert [rt.layout.dtype for rt in rts] == ["bfloat16", "bfloat16"]
        assert rts[0].fingerprint == rts[1].fingerprint
    finally:
        for rt in rts:
            rt.close()


def test_background_start_shows_only_this_starts_log_lines(runtime_dir: Path) -> None:
    (runtime_dir / "decode.log").write_text("".join(f"stale line {i}\n" for i in range(40)))
    proc = _start(runtime_dir, "--background", "--device", "cpu", "--model", "/nonexistent")
    assert proc.returncode == 3, proc.stderr
    assert "--model /nonexistent is not a directory" in proc.stderr, proc.stderr
    assert "stale line" not in proc.stderr, proc.stderr


def _api_start(runtime: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(runtime), "api", "start"]
    return subprocess.run([*argv, "--port", "0", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case", ["missing", "a-file", "no-config"])
def test_a_bad_model_dir_is_one_message_on_the_daemons_and_the_api(
    runtime_dir: Path, tmp_path: Path, case: str
) -> None:
    """`--model` naming nothing or a file: "is not a directory"; a directory without
    config.json: "has no config.json"; the same words from `pdkv decode start` and `pdkv api
    start`, each exiting 3."""
    path = tmp_path / "checkpoint"
    if case == "a-file":
        path.write_text("")
    elif case == "no-config":
        path.mkdir()
    says = f"--model {path} " + (
        "has no config.json" if case == "no-config" else "is not a directory"
    )
    daemon = _start(runtime_dir, "--device", "cpu", "--model", str(path))
    api = _api_start(runtime_dir, "--model", str(path))
    for proc in (daemon, api):
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert says in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout
