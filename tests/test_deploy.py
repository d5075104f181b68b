"""Deployment files: every YAML and JSON file under deploy/ parses; compose, Kubernetes and
the Dockerfile keep the properties the gateway depends on; the gateway settings they ship
are valid settings; launch_vllm.sh prints and checks its flags. The Kubernetes RBAC:
test_deploy_rbac.py; the metric names the rules and the dashboard query:
test_deploy_metrics.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gateway.settings import parse_settings
from tests.deploy_files import DASHBOARD, DEPLOY, configmap_toml, k8s_docs, load_yaml, pod_specs
from tests.servers import ROOT

YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
JSON_FILES = sorted(DEPLOY.rglob("*.json"))
VLLM_FLAGS = ("--enable-prompt-tokens-details", "--enable-prefix-caching",
              "--gpu-memory-utilization", "--max-model-len", "--kv-events-config")


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_parses(path: Path) -> None:
    docs = load_yaml(path)
    assert docs and all(isinstance(d, dict) for d in docs)


@pytest.mark.parametrize("path", JSON_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_json_parses(path: Path) -> None:
    assert isinstance(json.loads(path.read_text()), dict)


def test_there_is_something_to_parse() -> None:
    assert len(YAML_FILES) >= 15 and DASHBOARD in JSON_FILES


# ---- the gateway settings shipped with compose and Kubernetes are valid settings ----


@pytest.mark.parametrize("source", ["compose", "k8s"])
def test_shipped_gateway_settings_are_valid(source: str) -> None:
    text = ((DEPLOY / "gateway" / "gateway.toml").read_text() if source == "compose"
            else configmap_toml())
    s = parse_settings(text, {}, source=source)
    assert s.server.host == "0.0.0.0" and s.server.port == 8080
    assert [r.name for r in s.replicas] == ["vllm-0", "vllm-1"]
    assert s.usage.redis_url is not None and "redis:6379" in s.usage.redis_url


# ---- compose ----

@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    (doc,) = load_yaml(DEPLOY / "compose.yaml")
    return dict(doc)


def test_compose_services_and_profiles(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"gateway", "redis", "prometheus", "grafana"} <= set(services)
    for name in ("gateway", "redis", "prometheus", "grafana"):
        assert "profiles" not in services[name], name  # in both stacks
    for i in (0, 1):
        gpu, simulated = services[f"vllm-{i}"], services[f"sim-{i}"]
        assert gpu["profiles"] == ["gpu"] and simulated["profiles"] == ["sim"]
        # the sim replica answers to the vLLM replica's name: one gateway config for both
        assert simulated["networks"]["default"]["aliases"] == [f"vllm-{i}"]
        assert simulated["entrypoint"] == ["gateway", "sim"]
        assert "--host=0.0.0.0" in simulated["command"] and "--port=8000" in simulated["command"]
        (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [str(i)] and device["capabilities"] == ["gpu"]
        command = " ".join(gpu["command"])
        for flag in VLLM_FLAGS:
            assert flag in command, flag
        assert "models:/models" in gpu["volumes"]  # the shared model cache
    kv = next(a for a in services["vllm-0"]["command"] if a.startswith("--kv-events-config"))
    assert json.loads(kv.partition("=")[2])["enable_kv_cache_events"] is True


def test_compose_mounts_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), (name, source)
        build = service.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()



def test_kustomization_lists_every_manifest() -> None:
    (kust,) = load_yaml(DEPLOY / "k8s" / "kustomization.yaml")
    on_disk = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == on_disk


def test_k8s_pods_drop_service_links_and_have_probes() -> None:
    specs = dict(pod_specs())
    assert set(specs) == {"gateway", "redis", "vllm"}
    for name, spec in specs.items():
        assert spec["enableServiceLinks"] is False, name
        for container in spec["containers"]:
            assert "readinessProbe" in container and "livenessProbe" in container, name


def test_k8s_shape() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs()}
    gw = docs[("Deployment", "gateway")]
    assert gw["spec"]["replicas"] >= 2
    (container,) = gw["spec"]["template"]["spec"]["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gw["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    vllm = docs[("StatefulSet", "vllm")]
    (engine,) = vllm["spec"]["template"]["spec"]["containers"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for flag in VLLM_FLAGS:
        assert any(a.startswith(flag) for a in engine["args"]), flag
    assert {("PodDisruptionBudget", "gateway"), ("PodDisruptionBudget", "vllm"),
            ("Service", "gateway"), ("Service", "vllm"), ("Service", "redis"),
            ("ConfigMap", "gateway-config")} <= set(docs)
    # the ConfigMap's replica URLs are the StatefulSet's pod DNS names
    assert vllm["spec"]["serviceName"] == "vllm"
    assert "http://vllm-0.vllm:8000" in configmap_toml()


# ---- Dockerfile ----

def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert sum(ln.startswith("FROM ") for ln in lines) == 2  # build stage + runtime
    assert "slim" in text
    user = [ln for ln in lines if ln.startswith("USER ")]
    assert user and user[-1].split()[1].split(":")[0] not in ("root", "0")
    assert any(ln.startswith("HEALTHCHECK") for ln in lines) and "/health" in text
    assert 'ENTRYPOINT ["gateway", "serve"]' in lines
    assert "/etc/gateway/gateway.toml" in text
    # what it copies is in the build context (.dockerignore re-includes it)
    ignore = (ROOT / ".dockerignore").read_text().split()
    for ln in lines:
        if ln.startswith("COPY ") and "--from" not in ln:
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), src
                name = src.rstrip("/")
                assert {f"!{name}", f"!{name}/"} & set(ignore), src


# ---- launch_vllm.sh ----

LAUNCH = DEPLOY / "launch_vllm.sh"


def _launch(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # A directory with an executable named `vllm` satisfies the script's installation
    # check; --dry-run stops before anything is executed.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "vllm"
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True,
                          timeout=30, check=False, env=env)


def test_launch_vllm_prints_the_flags(tmp_path: Path) -> None:
    proc = _launch(["--dry-run", "--port", "8123", "--kv-events-port", "5557",
                    "--max-model-len", "8192", "--", "--block-size", "16"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (started,) = [ln for ln in proc.stderr.splitlines() if "starting:" in ln]
    for flag in (*VLLM_FLAGS, "--port 8123", "--max-model-len 8192", "--block-size 16",
                 "tcp://\\*:5557", "tcp://\\*:5558"):
        assert flag in started, flag


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--port", "70000"], "--port must be 1..65535"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--max-model-len", "big"], "--max-model-len"),
        (["--gpu", "zero"], "--gpu"),
        (["--bogus"], "unknown option --bogus"),
    ],
)
def test_launch_vllm_refuses_bad_values(args: list[str], needle: str, tmp_path: Path) -> None:
    proc = _launch(["--dry-run", *args], tmp_path)
    assert proc.returncode == 2
    assert needle in proc.stderr


def test_launch_vllm_without_vllm(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path)}  # no vllm, no python3
    proc = subprocess.run([shutil.which("bash") or "/bin/bash", str(LAUNCH), "--dry-run"],
                          capture_output=True, text=True, timeout=30, check=False, env=env)
    assert proc.returncode == 2 and "vllm is not installed" in proc.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed (Debian package shellcheck; .ci/run has it)")
def test_launch_vllm_shellcheck() -> None:
    proc = subprocess.run(["shellcheck", str(LAUNCH)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout
