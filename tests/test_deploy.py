"""The compose files as compose merges them: with the GPU override every service runs the one
image the override builds (a service left on pdkv:cpu would need a second build or a pull)."""

from __future__ import annotations

import re
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


def test_xpyd_compose_links_every_prefill_to_every_decode_and_the_api_to_every_prefill() -> None:
    svc = services("docker-compose.xpyd.yml")
    decodes = sorted(n for n in svc if n.startswith("decode"))
    prefills = sorted(n for n in svc if n.startswith("prefill"))
    assert len(decodes) == len(prefills) == 2
    sock = {n: f"{svc[n]['environment']['PDKV_RUNTIME_DIR']}" for n in (*decodes, *prefills)}
    assert len(set(sock.values())) == 4  # a runtime dir each
    for p in prefills:
        linked = svc[p]["environment"]["PDKV_DECODE"].split()
        assert linked == [f"{sock[d]}/decode.sock" for d in decodes]
        assert set(svc[p]["depends_on"]) == set(decodes)
    routed = svc["api"]["environment"]["PDKV_CLIENT_SOCKET"].split()
    assert routed == [f"{sock[p]}/prefill.sock" for p in prefills]
    # one IPC and PID namespace: every decode maps every prefill's pool
    owner = [n for n in (*decodes, *prefills) if svc[n].get("ipc") == "shareable"]
    assert owner == ["decode0"]
    for n in (*decodes, *prefills):
        if n != "decode0":
            assert svc[n]["ipc"] == svc[n]["pid"] == "service:decode0", n


def test_systemd_templates_are_the_units_with_an_instance_per_gpu() -> None:
    """pdkv-{decode,prefill}@.service run on cuda:%i in a runtime dir of their own, and are
    otherwise their plain unit (the hardening and life cycle must not drift apart)."""
    for role in ("decode", "prefill"):
        plain = (DEPLOY / "systemd" / f"pdkv-{role}.service").read_text()
        template = (DEPLOY / "systemd" / f"pdkv-{role}@.service").read_text()
        env = unit_values(f"pdkv-{role}@.service", "Environment")
        assert f"PDKV_RUNTIME_DIR=%t/pdkv/{role}-%i" in env and "PDKV_DEVICE=cuda:%i" in env
        assert unit_values(f"pdkv-{role}@.service", "RuntimeDirectory") == [f"pdkv pdkv/{role}-%i"]
        service = lambda text: [  # noqa: E731
            ln
            for ln in text.split("[Service]", 1)[1].splitlines()
            if ln and not ln.startswith(("#", "Environment", "RuntimeDirectory="))
        ]
        assert service(template) == service(plain)
    assert unit_values("pdkv-prefill@.service", "After") == ["pdkv-decode@%i.service"]


def test_the_xpyd_api_unit_is_the_api_unit_without_the_single_pair() -> None:
    """pdkv-api-xpyd.service pulls in no prefill unit (a Requires= of pdkv-prefill.service would
    start the single pair beside the instances) and is otherwise pdkv-api.service."""
    plain = (DEPLOY / "systemd" / "pdkv-api.service").read_text()
    xpyd = (DEPLOY / "systemd" / "pdkv-api-xpyd.service").read_text()
    for key in ("Requires", "Wants", "BindsTo", "Requisite"):
        assert unit_values("pdkv-api-xpyd.service", key) == [], key
    assert not any("prefill" in v for v in unit_values("pdkv-api-xpyd.service", "After"))
    assert unit_values("pdkv-api.service", "Requires") == ["pdkv-prefill.service"]
    assert xpyd.split("[Service]", 1)[1] == plain.split("[Service]", 1)[1]


def test_xpyd_k8s_pod_links_every_prefill_to_every_decode_in_one_ipc_and_pid_namespace() -> None:
    (deployment, _service) = k8s_docs("pdkv-xpyd.yaml")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True and pod["hostIPC"] is False
    containers = {c["name"]: c for c in pod["containers"]}
    env = {n: {e["name"]: e.get("value") for e in c["env"]} for n, c in containers.items()}
    decodes = sorted(n for n in containers if n.startswith("decode"))
    prefills = sorted(n for n in containers if n.startswith("prefill"))
    assert len(decodes) == len(prefills) == 2
    dirs = {n: env[n]["PDKV_RUNTIME_DIR"] for n in (*decodes, *prefills, "api")}
    assert len(set(dirs.values())) == 5  # a runtime dir each
    for p in prefills:
        assert env[p]["PDKV_DECODE"].split() == [f"{dirs[d]}/decode.sock" for d in decodes]
        assert containers[p]["args"] == ["prefill", "start"]
    assert env["api"]["PDKV_CLIENT_SOCKET"].split() == [f"{dirs[p]}/prefill.sock" for p in prefills]
    for n in (*decodes, *prefills):  # each daemon's probe asks its own runtime dir
        probe = containers[n]["readinessProbe"]["exec"]["command"]
        assert probe == ["sh", "-c", 'pdkv status "$PDKV_RUNTIME_DIR"'], n


def test_the_env_example_names_every_daemon_setting_and_the_apis() -> None:
    """deploy/systemd/pdkv.env.example is where a systemd user looks for a setting: each daemon
    option's and each API option's environment variable is in it (commented), none unknown."""
    from api_server.config import ApiConfig
    from common import settings
    from decode_server.config import DecodeConfig
    from prefill_server.config import PrefillConfig

    text = (DEPLOY / "systemd" / "pdkv.env.example").read_text()
    named = set(re.findall(r"^#?(PDKV_[A-Z_]+)=", text, re.M))
    daemons = {s.option.env for c in (DecodeConfig, PrefillConfig) for s in settings.declared(c)}
    api = {s.option.env for s in settings.declared(ApiConfig)}
    assert daemons - named == set() and api - named == set()
    # besides those: the global --log-level, and a variable no option has
    assert named - daemons - api == {"PDKV_LOG_LEVEL", "PDKV_SHARED_RUNTIME_DIR"}
