"""`gateway serve` started the way a Kubernetes pod starts it: with the service-link
variables the kubelet injects for Services named `gateway` and `gateway-redis` (one of
them, `GATEWAY_PORT=tcp://...`, looking like the port setting), a stray unknown
`GATEWAY_*` variable, and its real settings from the environment too."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from tests.servers import free_port, running, script

SERVICE_LINKS = {
    "GATEWAY_SERVICE_HOST": "10.96.0.11",
    "GATEWAY_SERVICE_PORT": "8080",
    "GATEWAY_SERVICE_PORT_HTTP": "8080",
    "GATEWAY_PORT": "tcp://10.96.0.11:8080",
    "GATEWAY_PORT_8080_TCP": "tcp://10.96.0.11:8080",
    "GATEWAY_PORT_8080_TCP_PROTO": "tcp",
    "GATEWAY_PORT_8080_TCP_PORT": "8080",
    "GATEWAY_PORT_8080_TCP_ADDR": "10.96.0.11",
    "GATEWAY_REDIS_SERVICE_HOST": "10.96.0.12",
    "GATEWAY_REDIS_PORT": "tcp://10.96.0.12:6379",
    "GATEWAY_REDIS_PORT_6379_TCP_ADDR": "10.96.0.12",
}


def test_serve_starts_with_kubernetes_service_links(tmp_path: Path) -> None:
    port = free_port()
    env = SERVICE_LINKS | {
        "GATEWAY_SERVER__PORT": str(port),  # a real setting next to the links still applies
        "GATEWAY_ROUTING__POLICY": "round_robin",
        "GATEWAY_FEATURE_FLAG": "1",  # names no setting: a warning, not a stop
    }
    log = tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    # no backend: the embedded simulator, so the gateway really routes a request
    with running([*script("gateway"), "serve", "--host", "127.0.0.1"], [url + "/ready"],
                 env=env, log_path=log):
        body = json.dumps({"model": "Qwen/Qwen2.5-7B-Instruct", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
            assert resp.headers["x-gateway-route"] == "round_robin"
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    links = [x for x in lines if "service-link" in x["msg"]]
    assert len(links) == 1, lines
    assert links[0]["level"] == "info"
    assert f"{len(SERVICE_LINKS)} Kubernetes service-link variables" in links[0]["msg"]
    unknown = [x for x in lines if "GATEWAY_FEATURE_FLAG" in x["msg"]]
    assert [x["level"] for x in unknown] == ["warning"]
