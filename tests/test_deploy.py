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
