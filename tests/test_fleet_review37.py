"""Outside review of issue 37 (a fleet that follows its sources): each test here is a break
found from outside, on loopback replicas (tests/test_fleet_sources_loopback.py's Pods and
scale helpers, tests/held_replica.py's Held). Here: replicas replaced or leaving while
requests are in flight or queued; the reloads: test_fleet_review37_reload.py; the DNS
answers: test_fleet_review37_dns.py."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx
import pytest

from gateway.admission.config import AdmissionConfig
from gateway.proxy.app import GatewayApp
from gateway.replicas import membership
from gateway.routing.config import RoutingConfig
from gateway.settings import Settings, parse_settings
from tests.held_replica import Held, predicted
from tests.proxy_fakes import chat
from tests.servers import free_port
from tests.test_fleet_sources_loopback import (
    DEADLINE_S,
    settings,
    until,
)

LABELS = {"app": "vllm"}


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
                    assert predicted(r2) == 0, r2.headers.get("x-gateway-cache")
                else:
                    assert predicted(r2) > 0, r2.headers.get("x-gateway-cache")
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
