"""The compose files as compose merges them: with the GPU override every service runs the one
image the override builds (a service left on pdkv:cpu would need a second build or a pull)."""

from __future__ import annotations

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def services(name: str) -> dict[str, dict]:
    return yaml.safe_load((DEPLOY / name).read_text())["services"]


def test_gpu_override_puts_every_service_on_the_cuda_image() -> None:
    base, gpu = services("docker-compose.yml"), services("docker-compose.gpu.yml")
    assert set(gpu) <= set(base), "the override names a service the base does not have"
    images = {name: gpu.get(name, {}).get("image", svc.get("image")) for name, svc in base.items()}
    assert set(images) >= {"decode", "prefill", "api"}
    assert set(images.values()) == {"${PDKV_IMAGE:-pdkv:cuda}"}, images


def test_only_the_daemons_reserve_gpus() -> None:
    gpu = services("docker-compose.gpu.yml")
    reserving = {n for n, s in gpu.items() if "devices" in str(s.get("deploy", {}))}
    assert reserving == {"decode", "prefill"}


def unit_values(name: str, key: str) -> list[str]:
    text = (DEPLOY / "systemd" / name).read_text()
    return [ln.split("=", 1)[1] for ln in text.splitlines() if ln.startswith(key + "=")]


def test_mps_unit_serves_the_daemons_user_on_the_pipe_they_are_told() -> None:
    """MPS serves only its server's user, and a client finds it by CUDA_MPS_PIPE_DIRECTORY."""
    users = {unit_values(f"pdkv-{r}.service", "User")[0] for r in ("decode", "prefill", "mps")}
    assert users == {"pdkv"}
    mps_env = dict(v.split("=", 1) for v in unit_values("pdkv-mps.service", "Environment"))
    example = (DEPLOY / "systemd" / "pdkv.env.example").read_text()
    assert f"#CUDA_MPS_PIPE_DIRECTORY={mps_env['CUDA_MPS_PIPE_DIRECTORY']}\n" in example
    assert "pdkv-decode.service" in unit_values("pdkv-mps.service", "Before")[0]
