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


def k8s_docs(name: str) -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()))


def test_crosshost_k8s_puts_the_daemons_on_two_nodes_linked_by_key() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs("pdkv-crosshost.yaml")}
    decode = docs[("Deployment", "pdkv-decode")]["spec"]["template"]["spec"]
    prefill = docs[("Deployment", "pdkv-prefill")]["spec"]["template"]["spec"]
    anti = prefill["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert anti[0]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"
    service = docs[("Service", "pdkv-decode-link")]["spec"]
    port = service["ports"][0]["port"]
    assert decode["containers"][0]["args"][2:] == ["--listen", f"tcp://$(POD_IP):{port}"]
    assert f"tcp://pdkv-decode-link:{port}" in prefill["containers"][0]["args"]
    config = docs[("ConfigMap", "pdkv-crosshost-config")]["data"]
    for spec in (decode, prefill):  # the daemon reads a 0600 copy, never the group-readable Secret
        (init,) = spec["initContainers"]
        assert "install -m 0600" in init["command"][-1]
        mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert config["PDKV_LINK_KEY_FILE"].rsplit("/", 1)[0] in mounts
        assert "/secret" not in mounts
    policy = docs[("NetworkPolicy", "pdkv-crosshost")]["spec"]["ingress"][0]["ports"]
    lo, hi = (int(x) for x in config["UCX_TCP_PORT_RANGE"].split("-"))
    assert {"protocol": "TCP", "port": lo, "endPort": hi} in policy
    assert {"protocol": "TCP", "port": port} in policy


def test_the_kernel_cache_is_on_a_persistent_path_in_every_deploy_file() -> None:
    """Triton's compiled kernels outlive a restart (issue 24, item 4): systemd keeps them in
    the unit's CacheDirectory, compose in a named volume (not the /tmp tmpfs), k8s on a claim."""
    for role in ("decode", "prefill"):
        unit = (DEPLOY / "systemd" / f"pdkv-{role}.service").read_text()
        assert "Environment=PDKV_KERNEL_CACHE_DIR=%C/pdkv/triton" in unit
        assert "CacheDirectory=pdkv" in unit
    for name in ("docker-compose.yml", "docker-compose.crosshost.yml"):
        compose = yaml.safe_load((DEPLOY / name).read_text())
        for role in ("decode", "prefill"):
            svc = compose["services"][role]
            path = svc["environment"]["PDKV_KERNEL_CACHE_DIR"]
            mounts = [v.split(":") for v in svc["volumes"]]
            volume = next(src for src, dst, *_ in mounts if path.startswith(dst + "/"))
            assert volume in compose["volumes"], (name, role, volume)
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "pdkv.yaml").read_text()))
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    for container in pod["containers"]:
        if container["name"] in ("decode", "prefill"):
            mount = next(
                m
                for m in container["volumeMounts"]
                if config["PDKV_KERNEL_CACHE_DIR"].startswith(m["mountPath"] + "/")
            )
            assert mount["name"] in claims
