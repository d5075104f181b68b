"""The Kubernetes RBAC shipped under deploy/k8s: what is granted is what the code's calls
need (the gateway's replica selector, the picker's pool watch), no more."""

from __future__ import annotations

import asyncio
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.settings import parse_settings
from tests.deploy_files import DEPLOY, configmap_toml, load_yaml, pod_specs

# ---- Kubernetes RBAC: what is granted is what the code's calls need ----

Grant = tuple[str, str, str]  # (API group, resource, verb)
_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def api_grant(method: str, path_qs: str) -> Grant:
    """The RBAC grant a request to the Kubernetes API server needs: its API group and
    resource from the path, its verb from the method, whether it names one object, and
    `watch` in the query."""
    url = urllib.parse.urlsplit(path_qs)
    parts = url.path.strip("/").split("/")
    # /api/v1/namespaces/NS/RESOURCE[/NAME] or /apis/GROUP/VERSION/namespaces/NS/...
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    assert rest[0] == "namespaces" and len(rest) >= 3, path_qs
    resource, named = rest[2], len(rest) > 3
    watch = urllib.parse.parse_qs(url.query).get("watch", [""])[-1] in ("true", "1")
    if method == "GET":
        verb = "watch" if watch else "get" if named else "list"
    elif method == "DELETE":
        verb = "delete" if named else "deletecollection"
    else:
        verb = _VERBS[method]
    return group, resource, verb


@pytest.mark.parametrize(("method", "path_qs", "grant"), [
    ("GET", "/api/v1/namespaces/ns/pods?labelSelector=app%3Dvllm", ("", "pods", "list")),
    ("GET", "/api/v1/namespaces/ns/pods?labelSelector=a&watch=true&resourceVersion=3",
     ("", "pods", "watch")),
    ("GET", "/api/v1/namespaces/ns/pods/vllm-0", ("", "pods", "get")),
    ("GET", "/apis/inference.networking.k8s.io/v1/namespaces/ns/inferencepools/vllm",
     ("inference.networking.k8s.io", "inferencepools", "get")),
    ("POST", "/api/v1/namespaces/ns/pods", ("", "pods", "create")),
    ("PATCH", "/api/v1/namespaces/ns/pods/vllm-0", ("", "pods", "patch")),
    ("DELETE", "/api/v1/namespaces/ns/pods/vllm-0", ("", "pods", "delete")),
    ("DELETE", "/api/v1/namespaces/ns/pods", ("", "pods", "deletecollection")),
])
def test_api_grant(method: str, path_qs: str, grant: Grant) -> None:
    assert api_grant(method, path_qs) == grant


def _rbac(path: Path) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in load_yaml(path)}


def _granted(role: dict[str, Any]) -> set[Grant]:
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


async def _needed(start: Callable[[Any, Callable[[], None]], Any], tmp_path: Path
                  ) -> set[Grant]:
    """The grants of every call the watch `start(api, found)` makes to a fake API server
    (tests/fake_kube.py) until it has listed a ready pod and is watching."""
    pytest.importorskip("kubernetes")
    from kubernetes import config

    from tests.fake_kube import fake_kube, pod

    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "vllm", "namespace": "ns"},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}},
                     "targetPorts": [{"number": 8000}]}}
    with fake_kube(pool) as kube:
        kube.put(pod("vllm-0", "127.0.0.1", True, {"app": "vllm"}))
        api = config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(kube.kubeconfig(tmp_path / "kubeconfig")))
        found = asyncio.Event()
        watch = start(api, found.set)
        try:
            await asyncio.wait_for(found.wait(), 30)
            for _ in range(3000):  # the watch request follows the list
                if any("watch=" in p for _, p in kube.calls):
                    break
                await asyncio.sleep(0.01)
        finally:
            watch.stop()
        return {api_grant(method, path) for method, path in kube.calls}


async def test_gateway_service_account_may_do_what_the_selector_does(tmp_path: Path) -> None:
    from gateway.replicas.sources import KubeSource
    from gateway.settings import DiscoverySettings

    discovery = DiscoverySettings(kubernetes_selector="app=vllm", kubernetes_port=8000,
                                  kubernetes_namespace="ns")

    def start(api: Any, found: Callable[[], None]) -> Any:
        source = KubeSource(discovery, api, lambda _source, replicas: replicas and found())
        source.start()
        return source

    rbac = _rbac(DEPLOY / "k8s" / "gateway-rbac.yaml")
    assert _granted(rbac["Role"]) == await _needed(start, tmp_path)
    # the Deployment runs under that account, bound to that role
    account = rbac["ServiceAccount"]["metadata"]["name"]
    assert rbac["RoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert rbac["RoleBinding"]["roleRef"]["name"] == rbac["Role"]["metadata"]["name"]
    spec = dict(pod_specs())["gateway"]
    assert spec["serviceAccountName"] == account
    # its token is mounted exactly when the shipped settings follow pods by label
    selector = parse_settings(configmap_toml(), {}).discovery.kubernetes_selector
    assert spec["automountServiceAccountToken"] is bool(selector)


async def test_picker_service_account_may_do_what_the_pool_watch_does(tmp_path: Path) -> None:
    from gateway.epp.pool import PoolWatch

    def start(api: Any, found: Callable[[], None]) -> Any:
        watch = PoolWatch(api, "ns", "vllm", lambda endpoints: endpoints and found(),
                          asyncio.get_running_loop())
        watch.start()
        return watch

    rbac = _rbac(DEPLOY / "k8s" / "epp" / "epp-rbac.yaml")
    assert _granted(rbac["Role"]) == await _needed(start, tmp_path)
