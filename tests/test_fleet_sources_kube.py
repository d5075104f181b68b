"""`gateway serve` following a Kubernetes label selector (`[discovery] kubernetes_selector`,
gateway.replicas.kube and sources.KubeSource): the pure parts by tables, then the pod watch
`gateway epp` uses, on the fake API server its tests use (tests/fake_kube.py: no real API
server can run here) through the official client and a real kubeconfig, scaling 2 -> 3 -> 1
while a load runs (the DNS scaling test's shape, tests/test_fleet_sources_loopback.py):
pods added, one turning unready, one deleted. A pod the selector does not pick, and a
ready pod without the named port, are never replicas."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gateway.proxy.app import GatewayApp
from gateway.replicas.kube import ready_endpoints
from gateway.replicas.sources import kube_identity, kube_members
from gateway.settings import DiscoverySettings, ReplicaSettings
from tests.fake_kube import fake_kube, pod
from tests.test_fleet_sources_loopback import (
    HOSTS,
    loaded,
    pods,
    port_on_every_host,
    scale,
    settings,
    until,
)

LABELS = {"app": "vllm"}


@pytest.mark.parametrize(("ports", "want"), [
    ([8000], {"a:8000": "http://10.0.0.1:8000", "b:8000": "http://[fd00::5]:8000"}),
    (["http"], {"a:9000": "http://10.0.0.1:9000"}),  # b declares no port named http
    (["metrics"], {"a:9100": "http://10.0.0.1:9100", "b:9200": "http://[fd00::5]:9200"}),
    (["nope"], {}),
])
def test_ready_endpoints_by_number_or_container_port_name(
        ports: list[int | str], want: dict[str, str]) -> None:
    pods_ = [pod("a", "10.0.0.1", True, LABELS, {"http": 9000, "metrics": 9100}),
             pod("b", "fd00::5", True, LABELS, {"metrics": 9200}),
             pod("c", "10.0.0.3", False, LABELS, {"http": 9000})]
    assert ready_endpoints(pods_, ports) == want


@pytest.mark.parametrize(("found", "bound", "want"), [
    ({"b:1": "http://u2:1", "a:1": "http://u1:1"}, 5, ["a:1", "b:1"]),
    # past the bound: the first names
    ({"b:1": "http://u2:1", "a:1": "http://u1:1", "c:1": "http://u3:1"}, 2, ["a:1", "b:1"]),
    ({}, 2, []),
])
def test_kube_members_are_bounded(found: dict[str, str], bound: int, want: list[str]) -> None:
    got = kube_members(found, bound, "key")
    assert list(got) == want
    assert all(got[n] == ReplicaSettings(name=n, url=found[n], api_key="key") for n in want)


@pytest.mark.parametrize(("fields", "ok"), [
    ({"kubernetes_selector": "app=vllm", "kubernetes_port": 8000}, True),
    ({"kubernetes_selector": "app=vllm", "kubernetes_port_name": "http"}, True),
    ({"kubernetes_selector": "app=vllm"}, False),  # no port
    ({"kubernetes_selector": "app=vllm", "kubernetes_port": 8000,
      "kubernetes_port_name": "http"}, False),  # both
    ({"kubernetes_selector": "app=vllm", "kubernetes_port": 70000}, False),
    ({}, True),
])
def test_selector_settings(fields: dict[str, Any], ok: bool) -> None:
    if ok:
        DiscoverySettings(**fields)
    else:
        with pytest.raises(ValueError):
            DiscoverySettings(**fields)


async def test_scaling_through_a_label_selector(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    port = port_on_every_host()
    named = {"http": port}
    pod_of = {f"vllm-{i}:{port}": (f"vllm-{i}", h) for i, h in enumerate(HOSTS)}
    with fake_kube({"metadata": {"name": "unused"}}) as kube:
        monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        # never replicas: another app's pod, and a ready pod without the named port
        kube.put(pod("other", "127.0.0.1", True, {"app": "other"}, named))
        kube.put(pod("unnamed", "127.0.0.2", True, LABELS, {"grpc": port}))
        app = GatewayApp(settings(kubernetes_selector="app=vllm", kubernetes_namespace="ns",
                                  kubernetes_port_name="http", grace_s=0.0))
        async with pods() as pool, app.running():
            names = {name: await pool.start(h, port) for name, (_, h) in pod_of.items()}

            async def set_members(members: list[str]) -> None:
                for name, (pod_name, host) in pod_of.items():
                    if name in members:
                        kube.put(pod(pod_name, host, True, LABELS, named))
                    elif pod_name == "vllm-0" and pod_name in kube.pods:
                        kube.put(pod(pod_name, host, False, LABELS, named))  # unready
                    elif pod_name in kube.pods:
                        kube.delete(pod_name)

            async with loaded(app) as load:
                await scale(app, pool, load, names, set_members)
            assert app.services is not None
            assert set(app.services.fleet.replicas) == {f"vllm-2:{port}"}
    assert any("watch=true" in r and "labelSelector=app%3Dvllm" in r
               for r in kube.requests), kube.requests


async def test_a_reload_without_the_selector_stops_the_watch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = port_on_every_host()
    named = {"http": port}
    with fake_kube({"metadata": {"name": "unused"}}) as kube:
        monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        kube.put(pod("vllm-0", HOSTS[0], True, LABELS, named))
        base = settings(kubernetes_selector="app=vllm", kubernetes_namespace="ns",
                        kubernetes_port_name="http", grace_s=0.0)
        app = GatewayApp(base)
        async with pods() as pool, app.running():
            await pool.start(HOSTS[0], port)
            await pool.start(HOSTS[1], port)
            services, sources = app.services, app.sources
            assert services is not None and sources is not None
            fleet = services.fleet
            await until("the pod up", lambda: {r.name for r in fleet.healthy()} == {
                f"vllm-0:{port}"})
            assert sources._kube is not None
            watch = sources._kube.watch
            await sources.reload((), DiscoverySettings(grace_s=0.0))
            await until("its replica departs", lambda: not fleet.replicas)
            assert not any(s.startswith("kubernetes:") for s in sources.membership.sources)
            # the watch is gone: a pod that turns ready now is no replica
            kube.put(pod("vllm-1", HOSTS[1], True, LABELS, named))
            # the stopped watch's thread ends at that event (the fake server's side of the
            # stream may stay open: aiohttp notices a client gone only at its next write)
            await until("the watch's thread ended", lambda: not watch._thread.is_alive())
            assert not fleet.replicas
            # and a reload that names the selector again follows the pods again
            await sources.reload((), base.discovery)
            await until("both pods up", lambda: {r.name for r in fleet.healthy()} == {
                f"vllm-0:{port}", f"vllm-1:{port}"})


@pytest.mark.parametrize(("change", "same"), [
    ({"grace_s": 1.0, "drain_timeout_s": 2.0}, True),
    ({"api_key": "k2", "max_replicas": 1, "dns": ("vllm:8000",), "dns_interval_s": 1.0}, True),
    ({"kubernetes_selector": "app=other"}, False),
    ({"kubernetes_namespace": "other"}, False),
    ({"kubernetes_port_name": "", "kubernetes_port": 8000}, False),
    ({"kubernetes_port_name": "vllm"}, False),
])
def test_kube_identity(change: dict[str, Any], same: bool) -> None:
    base = DiscoverySettings(kubernetes_selector="app=vllm", kubernetes_namespace="ns",
                             kubernetes_port_name="http")
    if "kubernetes_port" in change:  # a number against a number
        base = dataclasses.replace(base, kubernetes_port=9000, kubernetes_port_name="")
    assert (kube_identity(dataclasses.replace(base, **change)) == kube_identity(base)) is same


async def test_a_reload_of_the_same_selector_keeps_its_watch_under_new_parameters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new api_key and max_replicas for the same selector: the pods are published again
    at once under them (no second listing), and the one past the bound leaves."""
    port = port_on_every_host()
    named = {"http": port}
    with fake_kube({"metadata": {"name": "unused"}}) as kube:
        monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        for i in (0, 1):
            kube.put(pod(f"vllm-{i}", HOSTS[i], True, LABELS, named))
        base = settings(kubernetes_selector="app=vllm", kubernetes_namespace="ns",
                        kubernetes_port_name="http", grace_s=0.0)
        app = GatewayApp(base)
        async with pods() as pool, app.running():
            for i in (0, 1):
                await pool.start(HOSTS[i], port)
            services, sources = app.services, app.sources
            assert services is not None and sources is not None
            fleet = services.fleet
            first, second = f"vllm-0:{port}", f"vllm-1:{port}"
            await until("both pods up", lambda: {r.name for r in fleet.healthy()} == {
                first, second})
            listings = [r for r in kube.requests if "watch=true" not in r]
            await sources.reload((), dataclasses.replace(base.discovery, api_key="k2",
                                                         max_replicas=1))
            assert fleet.replicas[first].settings.api_key == "k2"
            assert fleet.replicas[first].leaving_since is None
            await until("the pod past the bound departs", lambda: second not in fleet.replicas)
            assert [r for r in kube.requests if "watch=true" not in r] == listings
