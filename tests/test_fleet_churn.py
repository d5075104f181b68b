"""20 rolling updates of a 10-pod InferencePool, through the pool watch's own seam
(`Members.apply`, what `PoolWatch` calls with every endpoint set), while health probing
and client requests go on: each pod is a real listener on loopback (its own port, so its
own origin in the client pools), replaced one at a time (the new pod joins and turns
healthy, then the old one leaves and stops listening). Then the same churn through the
official `kubernetes` client's watch of a fake API server (tests/fake_kube.py), the pods
sharing one listener (one address and target port, as loopback allows).

Shown: probing goes on at the live pods after every update; no ERROR is logged; requests
keep being answered; and what the gateway holds per replica stays bounded by the live
pods: `gateway_replica_healthy` series and every series labelled by replica in /metrics,
the client and probe pools' per-origin slots, pooled connections and closing records,
and any map the services reach (tests/held_names.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.epp.pool import Members, PoolWatch
from gateway.proxy.app import GatewayApp
from gateway.proxy.client import AiohttpUpstream
from gateway.settings import ServerSettings, Settings
from gateway.usage.config import UsageConfig
from tests.fake_kube import fake_kube, pod
from tests.held_names import names_held
from tests.proxy_fakes import COMPLETION, MODEL, chat
from tests.servers import free_port

PODS = 10
UPDATES = 20
DEADLINE_S = 20.0  # for any one condition; the whole test takes a few seconds unloaded


class Pods:
    """One aiohttp app listening on one port per pod; counts /health per port."""

    def __init__(self) -> None:
        self.health: Counter[int] = Counter()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        self.sites: dict[int, web.TCPSite] = {}

    async def _health(self, request: web.Request) -> web.Response:
        self.health[request.transport.get_extra_info("sockname")[1]] += 1  # type: ignore[union-attr]
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
                                 "vllm:kv_cache_usage_perc 0.1\n")

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=COMPLETION, content_type="application/json")

    async def start(self) -> int:
        port = free_port()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.sites[port] = site
        return port

    async def stop(self, port: int) -> None:
        await self.sites.pop(port).stop()


@contextlib.asynccontextmanager
async def pods() -> AsyncIterator[Pods]:
    p = Pods()
    await p.runner.setup()
    try:
        yield p
    finally:
        await p.runner.cleanup()


async def until(what: str, ok: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not ok():
        assert loop.time() < end, f"not within {DEADLINE_S} s: {what}"
        await asyncio.sleep(0.005)


def probed_again(pool: Pods, ports: list[int]) -> Callable[[], bool]:
    """True once the health loop probed each port twice more than now (two rounds: one
    may have begun before this)."""
    seen = {p: pool.health[p] for p in ports}
    return lambda: all(pool.health[p] >= seen[p] + 2 for p in ports)


def _settings() -> Settings:
    server = ServerSettings(health_interval_s=0.05, health_timeout_s=1.0, models_refresh_s=0.2,
                            unhealthy_after=1)
    # no replicas configured: the pool's pods are the fleet (as `gateway epp` with a pool)
    return Settings(replicas=(), server=server,
                    usage=UsageConfig(startup_probe=False, scrape_interval_s=0.05))


def _replica_labels(text: str) -> Counter[str]:
    return Counter(re.findall(r'replica="([^"]*)"', text))


async def test_rolling_updates_keep_probing_and_stay_bounded(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    app = GatewayApp(_settings())
    statuses: Counter[int] = Counter()
    departed: set[str] = set()
    async with pods() as pool, app.running():
        services = app.services
        assert services is not None
        members = Members(services.fleet, services.monitor, services.remove_replica,
                          lambda endpoints: None)
        live: dict[str, str] = {}  # replica name -> URL, as the watch would hand them

        async def join(name: str) -> None:
            port = await pool.start()
            live[name] = f"http://127.0.0.1:{port}"
            members.apply(dict(live))
            await until(f"{name} healthy", lambda: name in services.fleet.replicas
                        and services.fleet.replicas[name].healthy)

        for k in range(PODS):
            await join(f"vllm-0-{k}:8000")

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                     timeout=DEADLINE_S) as client:
            stop = asyncio.Event()

            async def requests() -> None:
                while not stop.is_set():
                    r = await client.post("/v1/chat/completions", json=chat())
                    statuses[r.status_code] += 1

            workers = [asyncio.create_task(requests()) for _ in range(4)]
            try:
                for update in range(1, UPDATES + 1):
                    answered = sum(statuses.values())
                    for k in range(PODS):
                        old = f"vllm-{update - 1}-{k}:8000"
                        await join(f"vllm-{update}-{k}:8000")
                        old_port = int(live.pop(old).rsplit(":", 1)[1])
                        members.apply(dict(live))  # the old pod leaves, then stops
                        departed.add(old)
                        await pool.stop(old_port)
                    # probing goes on: every live pod probed again by the health loop
                    ports = [int(u.rsplit(":", 1)[1]) for u in live.values()]
                    await until(f"update {update}: every live pod probed again",
                                probed_again(pool, ports))
                    await until(f"update {update}: requests answered",
                                lambda: sum(statuses.values()) > answered)  # noqa: B023
                    text = (await client.get("/metrics")).text
                    healthy = text.count("gateway_replica_healthy{")
                    assert healthy == PODS, (update, healthy)
            finally:
                stop.set()
                await asyncio.gather(*workers)

            text = (await client.get("/metrics")).text
            labels = _replica_labels(text)
            assert set(labels) <= {*live, "none", "departed"}, sorted(set(labels) - {*live})
            assert text.count("gateway_replica_healthy{") == PODS
            assert {n for n in labels if n in live} == set(live)

        # per-origin state of both pools: the live pods' origins only
        origins = {u for u in live.values()}
        live_ports = {int(u.rsplit(":", 1)[1]) for u in origins}
        for pool_name in ("upstream", "probes"):
            client_pool = getattr(services, pool_name)
            assert isinstance(client_pool, AiohttpUpstream)
            assert set(client_pool._slots) <= origins, (pool_name, len(client_pool._slots))
            session = client_pool._session
            assert session is not None
            conns = session.connector._conns  # type: ignore[union-attr]
            assert {k.port for k in conns} <= live_ports, pool_name
            closing = client_pool._closing
            assert {p for _, p in (*closing._closed, *closing._answers)} <= live_ports
        assert names_held(services, departed) == []
        assert len(services.fleet.replicas) == PODS

    assert len(departed) == PODS * UPDATES
    assert statuses[200] >= sum(statuses.values()) * 0.99, statuses
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def _pool(port: int) -> dict[str, Any]:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "vllm", "namespace": "ns"},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}},
                     "targetPorts": [{"number": port}]}}


async def test_rolling_updates_through_the_kubernetes_watch(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from kubernetes import config

    caplog.set_level(logging.INFO)
    app = GatewayApp(_settings())
    async with pods() as pool, app.running():
        port = await pool.start()
        services = app.services
        assert services is not None
        fleet = services.fleet
        members = Members(fleet, services.monitor, services.remove_replica,
                          lambda endpoints: None)
        with fake_kube(_pool(port)) as kube:
            api = config.new_client_from_config(  # type: ignore[no-untyped-call]
                config_file=str(kube.kubeconfig(tmp_path / "kubeconfig")))
            watch = PoolWatch(api, "ns", "vllm", members.apply, asyncio.get_running_loop())
            watch.start()
            try:
                for k in range(PODS):
                    kube.put(pod(f"vllm-0-{k}", "127.0.0.1", True, {"app": "vllm"}))
                await until("the first pods up", lambda: len(fleet.healthy()) == PODS)
                for update in range(1, UPDATES + 1):
                    for k in range(PODS):
                        new, old = f"vllm-{update}-{k}:{port}", f"vllm-{update - 1}-{k}:{port}"
                        kube.put(pod(new.split(":")[0], "127.0.0.1", True, {"app": "vllm"}))
                        await until(f"{new} up", lambda: new in fleet.replicas  # noqa: B023
                                    and fleet.replicas[new].healthy)  # noqa: B023
                        kube.delete(old.split(":")[0])
                        await until(f"{old} gone", lambda: old not in fleet.replicas)  # noqa: B023
                    probed = probed_again(pool, [port])
                    await until(f"update {update}: probing goes on", probed)
                live = set(fleet.replicas)
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
                    text = (await c.get("/metrics")).text
                assert text.count("gateway_replica_healthy{") == PODS
                assert set(_replica_labels(text)) <= {*live, "none", "departed"}
                departed = {f"vllm-{u}-{k}:{port}" for u in range(UPDATES) for k in range(PODS)}
                assert names_held(services, departed) == []
            finally:
                watch.stop()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
