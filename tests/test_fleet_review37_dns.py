"""Outside review of issue 37 (a fleet that follows its sources), on loopback replicas:
DNS answers with duplicates, IPv6 or no address at all, while requests are in flight."""

from __future__ import annotations

import asyncio

import httpx

from gateway.proxy.app import GatewayApp
from tests.held_names import names_held
from tests.held_replica import Held
from tests.proxy_fakes import chat
from tests.servers import free_port
from tests.test_fleet_sources_loopback import (
    DEADLINE_S,
    HOSTS,
    pods,
    port_on_every_host,
    settings,
    until,
)

LABELS = {"app": "vllm"}


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
