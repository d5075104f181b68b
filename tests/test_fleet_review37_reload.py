"""Outside review of issue 37 (a fleet that follows its sources), on loopback replicas:
what a settings reload (SIGHUP) keeps and changes while the fleet follows its sources."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest

from gateway.proxy.app import GatewayApp
from gateway.settings import Settings, parse_settings
from tests.fake_kube import fake_kube, pod
from tests.held_replica import Held
from tests.proxy_fakes import chat
from tests.test_fleet_sources_loopback import (
    DEADLINE_S,
    HOSTS,
    pods,
    port_on_every_host,
    settings,
    until,
)

LABELS = {"app": "vllm"}


async def test_a_reload_that_changes_grace_keeps_the_selectors_pods_routed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGHUP whose [discovery] differs in anything (here grace_s only; the same selector)
    must not take the label selector's pods out of routing: they are still listed. Found:
    `FleetSources._reload` drops the `kubernetes:` source before the new watch has listed,
    and reconciles, so every pod leaves (marked down at once: 503s for every request until
    the new watch lists and a probe marks them up again; past grace_s they depart and are
    learned from scratch)."""
    port = port_on_every_host()
    named = {"http": port}
    with fake_kube({"metadata": {"name": "unused"}}) as kube:
        monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        kube.put(pod("vllm-0", HOSTS[0], True, LABELS, named))
        base = settings(kubernetes_selector="app=vllm", kubernetes_namespace="ns",
                        kubernetes_port_name="http", grace_s=30.0)
        app = GatewayApp(base)
        async with pods() as pool, app.running():
            await pool.start(HOSTS[0], port)
            services, sources = app.services, app.sources
            assert services is not None and sources is not None
            fleet = services.fleet
            name = f"vllm-0:{port}"
            await until("the pod up", lambda: {r.name for r in fleet.healthy()} == {name})
            replica = fleet.replicas[name]
            changed = dataclasses.replace(base.discovery, grace_s=10.0)
            await sources.reload((), changed)
            assert replica.leaving_since is None, "a listed pod left on an unrelated reload"
            assert replica.healthy


async def test_a_reloaded_api_key_under_the_same_name_and_url_is_sent(tmp_path: Path) -> None:
    """A reloaded [[replicas]] entry whose api_key changed (same name, same url) is an
    update: the next request carries the new key, probes too (the engine was restarted
    with a rotated --api-key); no request after the reload carries the old one."""
    a = Held()
    a.release.set()
    url = await a.start()
    path = tmp_path / "gateway.toml"
    base = settings(grace_s=0.0)

    def write(key: str) -> None:
        path.write_text(f'[[replicas]]\nname = "a"\nurl = "{url}"\napi_key = "{key}"\n')

    def reload() -> Settings:
        return dataclasses.replace(base, replicas=parse_settings(path.read_text(), {}).replicas)

    write("sk-old")
    app = GatewayApp(reload(), reload=reload)
    try:
        async with app.running():
            services = app.services
            assert services is not None
            fleet = services.fleet
            await until("a up", lambda: bool(fleet.healthy()))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                         timeout=DEADLINE_S) as client:
                assert (await client.post("/v1/chat/completions", json=chat())).status_code \
                    == 200
                write("sk-new")
                assert await app.reload_settings()
                seen = len(a.auth)
                assert (await client.post("/v1/chat/completions", json=chat())).status_code \
                    == 200
                await until("a probe after the reload", lambda: any(
                    p == "health" for p, _ in a.auth[seen:]))
                after = a.auth[seen:]
                assert ("chat", "Bearer sk-new") in after, after
                assert all(key == "Bearer sk-new" for _, key in after), after
    finally:
        a.release.set()  # a failed check leaves no request held through the shutdown
        await a.runner.cleanup()
