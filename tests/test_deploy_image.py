"""The image's health check follows the configured port (the health URL by table, and
against a gateway on another port), the Dockerfile's `docker run` example mounts settings
that name no compose-only host, and the vLLM images are pinned to the version the gateway
is tested with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.settings import parse_settings
from tests.servers import ROOT, free_port, running, script

DEPLOY = ROOT / "deploy"

@pytest.mark.parametrize(("toml", "env", "url"), [
    (None, {}, "http://127.0.0.1:8080/health"),
    ("[server]\nport = 9000\nhost = '0.0.0.0'", {}, "http://127.0.0.1:9000/health"),
    ("[server]\nport = 9000", {"GATEWAY_SERVER__PORT": "9100"}, "http://127.0.0.1:9100/health"),
    (None, {"GATEWAY_PORT": "9200"}, "http://127.0.0.1:9200/health"),
    ("[server]\nhost = '::'\nport = 9300", {}, "http://[::1]:9300/health"),
])  # fmt: skip
def test_healthcheck_follows_the_configured_port(toml: str | None, env: dict[str, str],
                                                 url: str) -> None:
    from gateway.healthcheck import health_url

    assert health_url(toml, env) == url


def test_healthcheck_against_a_gateway_on_another_port(tmp_path: Path) -> None:
    port = free_port()
    conf = tmp_path / "gateway.toml"
    conf.write_text(f"[server]\nport = {port}\n")
    check = [sys.executable, "-m", "gateway.healthcheck", str(conf)]
    assert subprocess.run(check, capture_output=True, check=False).returncode == 1  # not up
    with running([*script("gateway"), "serve", "--config", str(conf)],
                 [f"http://127.0.0.1:{port}/ready"]):
        done = subprocess.run(check, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_dockerfile_health_check_and_docker_run_example() -> None:
    text = (ROOT / "Dockerfile").read_text()
    check = next(ln for ln in text.splitlines() if ln.strip().startswith("CMD [\"python\""))
    assert "8080" not in check and "gateway.healthcheck" in check
    # the `docker run` example mounts settings that name no compose-only host
    example = next(ln for ln in text.splitlines() if ":/etc/gateway/gateway.toml" in ln)
    mounted = ROOT / example.split("-v $PWD/")[1].split(":")[0]
    settings = parse_settings(mounted.read_text(), {})
    assert settings.replicas == () and settings.usage.redis_url is None
    assert not settings.redis.enabled


def test_vllm_images_are_pinned() -> None:
    compose = (DEPLOY / "compose.yaml").read_text()
    assert "vllm/vllm-openai:${VLLM_TAG:-v0.32.0}" in compose
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    tags = {i["name"]: i.get("newTag") for i in kust["images"]}
    assert tags["vllm/vllm-openai"] == "v0.32.0"
