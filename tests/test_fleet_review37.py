"""Outside review of issue 37 (a fleet that follows its sources): each test here is a break
found from outside, on loopback replicas (tests/test_fleet_sources_loopback.py's Pods and
scale helpers, tests/fake_kube.py's API server)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from gateway.admission.config import AdmissionConfig
from gateway.proxy.app import GatewayApp
from gateway.replicas import membership
from gateway.routing.config import RoutingConfig
from gateway.settings import Settings, parse_settings
from tests.fake_kube import fake_kube, pod
from tests.held_names import names_held
from tests.proxy_fakes import COMPLETION, MODEL, chat
from tests.servers import free_port
from tests.test_fleet_sources_loopback import (
    DEADLINE_S,
    ENGINE_METRICS,
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



class Held:
    """A loopback replica whose chat answers wait until `release` is set; what it was asked."""

    def __init__(self) -> None:
        self.chats = 0
        self.auth: list[tuple[str, str]] = []  # ("health" | "chat", its Authorization)
        self.release = asyncio.Event()
        self.arrived = asyncio.Event()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        self.port = 0

    async def _health(self, request: web.Request) -> web.Response:
        self.auth.append(("health", request.headers.get("Authorization", "")))
        return web.Response()

    @staticmethod
    async def _metrics(_request: web.Request) -> web.Response:
        return web.Response(text=ENGINE_METRICS)

    @staticmethod
    async def _models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.auth.append(("chat", request.headers.get("Authorization", "")))
        self.chats += 1
        self.arrived.set()
        await self.release.wait()
        return web.Response(body=COMPLETION, content_type="application/json")

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        await self.runner.setup()
        self.port = port or free_port()
        await web.TCPSite(self.runner, host, self.port).start()
        return f"http://{host}:{self.port}"


def _predicted(resp: httpx.Response) -> int:
    found = re.search(r"predicted=(\d+)", resp.headers.get("x-gateway-cache", ""))
    return int(found.group(1)) if found else 0


@pytest.mark.parametrize("moved", [True, False])
async def test_a_request_in_flight_to_a_replaced_address_teaches_nothing_of_the_new_one(
        tmp_path: Path, moved: bool) -> None:
    """A replica whose name comes back at another address (a pod recreated with a new IP; a
    reloaded [[replicas]] url) is another server with an empty cache: a request still in
    flight to the old address must not teach the router that the new one holds its prompt.
    Found: `Membership.reconcile` replaces at once (`remove` then `Fleet.add` under the same
    name) and the old request's `Router.report` (gateway/proxy/flow.py finish) files its
    blocks under the name, now the new server's: the next request with that prompt is
    routed on a predicted hit the new server cannot give (moved=False is the control: the
    same server, the prediction is right)."""
    old, new = Held(), Held()
    url_old, url_new = await old.start(), await new.start()
    new.release.set()
    path = tmp_path / "gateway.toml"
    base = dataclasses.replace(settings(grace_s=0.0),
                               routing=RoutingConfig())  # the cache-aware default policy

    def write(url: str) -> None:
        path.write_text(f'[[replicas]]\nname = "a"\nurl = "{url}"\n')

    def reload() -> Settings:
        return dataclasses.replace(base, replicas=parse_settings(path.read_text(), {}).replicas)

    write(url_old)
    app = GatewayApp(dataclasses.replace(base, replicas=parse_settings(
        path.read_text(), {}).replicas), reload=reload)
    try:
        async with app.running():
            services = app.services
            assert services is not None
            fleet = services.fleet
            await until("a up", lambda: bool(fleet.healthy()))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                         timeout=DEADLINE_S) as client:
                body = chat()
                first = asyncio.create_task(client.post("/v1/chat/completions", json=body))
                await asyncio.wait_for(old.arrived.wait(), DEADLINE_S)
                if moved:
                    write(url_new)
                    assert await app.reload_settings()
                    await until("the new a up", lambda: fleet.replicas["a"].url == url_new
                                and fleet.replicas["a"].healthy)
                old.release.set()
                r1 = await first
                assert r1.status_code == 200
                r2 = await client.post("/v1/chat/completions", json=body)
                assert r2.status_code == 200
                if moved:
                    assert new.chats == 1 and old.chats == 1
                    assert _predicted(r2) == 0, r2.headers.get("x-gateway-cache")
                else:
                    assert _predicted(r2) > 0, r2.headers.get("x-gateway-cache")
    finally:
        old.release.set()
        await old.runner.cleanup()
        await new.runner.cleanup()


async def test_requests_queued_for_admission_when_a_replica_leaves(tmp_path: Path) -> None:
    """[admission] on, one request per replica: a and b each hold one, two more wait in the
    queue; a reload removes a. Each request gets exactly one answer, a receives nothing
    after it left (its one request finishes there), the queued ones go to b, and a departs
    once its request is done (not held to drain_timeout_s)."""
    a, b = Held(), Held()
    urls = {"a": await a.start(), "b": await b.start()}
    path = tmp_path / "gateway.toml"
    base = dataclasses.replace(
        settings(grace_s=0.0, drain_timeout_s=600.0),
        admission=AdmissionConfig(enabled=True, replica_max_in_flight=1))

    def write(names: list[str]) -> None:
        path.write_text("".join(f'[[replicas]]\nname = "{n}"\nurl = "{urls[n]}"\n'
                                for n in names))

    def reload() -> Settings:
        return dataclasses.replace(base, replicas=parse_settings(path.read_text(), {}).replicas)

    write(["a", "b"])
    app = GatewayApp(reload(), reload=reload)
    try:
        async with app.running():
            services = app.services
            assert services is not None and services.gate is not None
            fleet, gate = services.fleet, services.gate
            await until("both up", lambda: len(fleet.healthy()) == 2)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                         timeout=DEADLINE_S) as client:
                def send(i: int) -> asyncio.Task[httpx.Response]:
                    return asyncio.create_task(client.post(
                        "/v1/chat/completions", json=chat(user=f"u{i}")))

                sent = [send(0), send(1)]
                await until("one on each", lambda: a.chats == 1 and b.chats == 1)
                sent += [send(2), send(3)]
                await until("two queued", lambda: gate._count == 2)
                write(["b"])
                assert await app.reload_settings()
                assert fleet.replicas["a"].leaving_since is not None
                b.release.set()
                a.release.set()
                answers = [await asyncio.wait_for(t, DEADLINE_S) for t in sent]
                assert [r.status_code for r in answers] == [200] * 4
                assert (a.chats, b.chats) == (1, 3)
                assert sorted(r.headers["x-gateway-replica"] for r in answers) == [
                    "a", "b", "b", "b"]
                await until("a departs", lambda: "a" not in fleet.replicas)
    finally:
        a.release.set()  # a failed check leaves no request held through the shutdown
        await a.runner.cleanup()
        await b.runner.cleanup()


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


async def test_leaving_replicas_are_bounded_through_membership(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`MAX_LEAVING` bounds the replicas kept while they drain (membership.py): DNS lists 6
    addresses, then none, with a grace period far longer than the test; at most the bound
    stay, the oldest departing first. (The pure `overflow` has a table; nothing showed the
    membership applying it.)"""
    monkeypatch.setattr(membership, "MAX_LEAVING", 2)
    port = free_port()
    answers = [f"127.0.0.{i}" for i in range(10, 16)]

    async def resolve(host: str, asked: int) -> list[str]:
        return list(answers)

    app = GatewayApp(settings(dns=(f"vllm.test:{port}",), dns_interval_s=0.05,
                              grace_s=3600.0, drain_timeout_s=3600.0), resolver=resolve)
    async with app.running():
        services = app.services
        assert services is not None
        fleet = services.fleet
        await until("six listed", lambda: len(fleet.replicas) == 6)
        answers[:] = []
        await until("all but the bound departed", lambda: len(fleet.replicas) <= 2)
        assert all(r.leaving_since is not None for r in fleet.replicas.values())


async def test_a_leaving_replica_stays_until_its_request_in_flight_is_done(
        tmp_path: Path) -> None:
    """grace_s = 0 and a request in flight on a: a reload that removes a makes it leave (no
    new request) but not depart while the request runs, across reaper rounds; it departs
    once the request is answered. (No test held a replica's departure to its in-flight
    requests: `departure_due`'s in_flight argument replaced by 0 at its call in
    `Membership._reap_now` passed every fleet test.)"""
    a, b = Held(), Held()
    b.release.set()
    urls = {"a": await a.start(), "b": await b.start()}
    path = tmp_path / "gateway.toml"
    base = settings(grace_s=0.0, drain_timeout_s=600.0)

    def write(names: list[str]) -> None:
        path.write_text("".join(f'[[replicas]]\nname = "{n}"\nurl = "{urls[n]}"\n'
                                for n in names))

    def reload() -> Settings:
        return dataclasses.replace(base, replicas=parse_settings(path.read_text(), {}).replicas)

    write(["a"])
    app = GatewayApp(reload(), reload=reload)
    try:
        async with app.running():
            services, sources = app.services, app.sources
            assert services is not None and sources is not None
            fleet = services.fleet
            await until("a up", lambda: bool(fleet.healthy()))
            rounds = [0]
            reap = sources.membership._reap_now

            def counted(now: float) -> None:
                rounds[0] += 1
                reap(now)

            sources.membership._reap_now = counted  # type: ignore[method-assign]
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                         timeout=DEADLINE_S) as client:
                first = asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
                await asyncio.wait_for(a.arrived.wait(), DEADLINE_S)
                write(["b"])
                assert await app.reload_settings()
                begun = rounds[0]
                await until("three reaper rounds", lambda: rounds[0] >= begun + 3)
                assert "a" in fleet.replicas, "departed with a request in flight"
                assert fleet.replicas["a"].leaving_since is not None
                a.release.set()
                r = await asyncio.wait_for(first, DEADLINE_S)
                assert r.status_code == 200 and r.headers["x-gateway-replica"] == "a"
                await until("a departs", lambda: "a" not in fleet.replicas)
    finally:
        a.release.set()  # a failed check leaves no request held through the shutdown
        await a.runner.cleanup()
        await b.runner.cleanup()


async def test_a_dns_answer_with_duplicates_and_ipv6_then_without_it() -> None:
    """A DNS answer naming ::1 twice and 127.0.0.1 (an AAAA and an A record of a dual-stack
    Service): two replicas, the IPv6 one `[::1]:port` at `http://[::1]:port`, both routed;
    the answer without ::1 makes it depart, and nothing of it stays (its name, its
    address, its origin in the client pools)."""
    port = free_port()
    answers = ["::1", "::1", "127.0.0.1"]

    async def resolve(host: str, asked: int) -> list[str]:
        return list(answers)

    app = GatewayApp(settings(dns=(f"vllm.test:{port}",), dns_interval_s=0.05, grace_s=0.0),
                     resolver=resolve)
    v6, v4 = f"[::1]:{port}", f"127.0.0.1:{port}"
    async with pods() as pool, app.running():
        await pool.start("::1", port)
        await pool.start("127.0.0.1", port)
        services = app.services
        assert services is not None
        fleet = services.fleet
        await until("both up", lambda: {r.name for r in fleet.healthy()} == {v6, v4})
        assert fleet.replicas[v6].url == f"http://{v6}"
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                     timeout=DEADLINE_S) as client:
            served = set()
            for i in range(8):
                r = await client.post("/v1/chat/completions", json=chat(user=f"u{i}"))
                assert r.status_code == 200
                served.add(r.headers["x-gateway-replica"])
            assert served == {v6, v4}
            answers[:] = ["127.0.0.1"]
            await until("::1 departs", lambda: set(fleet.replicas) == {v4})
            r = await client.post("/v1/chat/completions", json=chat())
            assert r.status_code == 200 and r.headers["x-gateway-replica"] == v4
            text = (await client.get("/metrics")).text
        assert "::1" not in text
        assert names_held(services, [v6, "::1", f"http://{v6}"]) == []


async def test_a_dns_answer_with_no_address_while_a_request_is_in_flight() -> None:
    """Every address gone from the answer (the Deployment scaled to 0) while a request runs
    on one: that request is answered by its replica; new ones get an OpenAI-shaped 503 at
    once; /ready says not ready and /metrics still renders; the replicas depart once idle;
    the name answering again brings the fleet back."""
    port = port_on_every_host()
    answers = list(HOSTS[:2])

    async def resolve(host: str, asked: int) -> list[str]:
        return list(answers)

    a, b = Held(), Held()
    b.release.set()
    await a.start(HOSTS[0], port)
    await b.start(HOSTS[1], port)
    names = [f"{h}:{port}" for h in HOSTS[:2]]
    app = GatewayApp(settings(dns=(f"vllm.test:{port}",), dns_interval_s=0.05, grace_s=0.0,
                              drain_timeout_s=600.0), resolver=resolve)
    try:
        async with app.running():
            services = app.services
            assert services is not None
            fleet = services.fleet
            await until("both up", lambda: len(fleet.healthy()) == 2)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                         timeout=DEADLINE_S) as client:
                held: list[asyncio.Task[httpx.Response]] = []
                while a.chats == 0:  # round robin: a takes one of the first two
                    held.append(asyncio.create_task(client.post(
                        "/v1/chat/completions", json=chat())))
                    await until("an answer or a's request", lambda: a.chats > 0 or all(
                        t.done() for t in held))
                answers[:] = []
                await until("all leaving", lambda: not fleet.healthy())
                r = await client.post("/v1/chat/completions", json=chat())
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "no_healthy_replica"
                assert (await client.get("/ready")).status_code == 503
                assert (await client.get("/metrics")).status_code == 200
                await until("b departs", lambda: names[1] not in fleet.replicas)
                assert names[0] in fleet.replicas  # its request runs on
                a.release.set()
                done = [await asyncio.wait_for(t, DEADLINE_S) for t in held]
                assert [x.status_code for x in done] == [200] * len(done)
                assert done[-1].headers["x-gateway-replica"] == names[0]
                await until("a departs", lambda: not fleet.replicas)
                answers[:] = list(HOSTS[:2])
                await until("both back", lambda: len(fleet.healthy()) == 2)
                r = await client.post("/v1/chat/completions", json=chat())
                assert r.status_code == 200
    finally:
        a.release.set()
        await a.runner.cleanup()
        await b.runner.cleanup()
