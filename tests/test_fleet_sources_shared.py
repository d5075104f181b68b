"""Two gateway instances sharing routing state through a real redis-server
(tests/redis_server.py), each following the same DNS name (the resolver seam) in front of
loopback replicas: a replica that leaves is forgotten by both (every map of their services,
tests/held_names.py), including while the other instance, whose resolution is late, still
routes to it and publishes facts about it (those facts are not applied by the instance it
already left), and nothing of it comes back from the stream afterwards."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.proxy.app import GatewayApp
from gateway.proxy.services import Services
from gateway.replicas.sources import Resolver
from gateway.shared.config import RedisSettings
from tests.held_names import names_held
from tests.proxy_fakes import chat
from tests.redis_server import needs_redis, redis_server
from tests.servers import free_port
from tests.test_fleet_sources_loopback import HOSTS, pods, port_on_every_host, settings, until

pytest.importorskip("redis")


@contextlib.asynccontextmanager
async def client(app: GatewayApp) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw", timeout=30) as c:
        yield c


@needs_redis
async def test_a_departed_replica_is_forgotten_by_every_instance() -> None:
    port, redis_port = port_on_every_host(), free_port()
    first, second = f"{HOSTS[0]}:{port}", f"{HOSTS[1]}:{port}"
    answers = {"a": [HOSTS[0], HOSTS[1]], "b": [HOSTS[0], HOSTS[1]]}

    def resolver(instance: str) -> Resolver:
        async def resolve(host: str, asked: int) -> list[str]:
            return list(answers[instance])
        return resolve

    base = dataclasses.replace(
        settings(dns=(f"vllm.test:{port}",), dns_interval_s=0.05, grace_s=0.0),
        redis=RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0"))
    a, b = (GatewayApp(base, resolver=resolver(i)) for i in ("a", "b"))
    with redis_server(redis_port):
        async with (pods() as pool, a.running(), b.running(), client(a) as ca,
                    client(b) as cb):
            for h in HOSTS[:2]:
                await pool.start(h, port)
            sa, sb = a.services, b.services
            assert sa is not None and sb is not None
            assert sa.shared is not None and sb.shared is not None
            shared_a, shared_b = sa.shared, sb.shared

            def healthy(services: Services) -> set[str]:
                return {r.name for r in services.fleet.healthy()}

            for s in (sa, sb):
                await until("both replicas up", lambda s=s: healthy(s) == {first, second})

            async def send(c: httpx.AsyncClient, n: int, tag: str) -> set[str]:
                where = set()
                for i in range(n):
                    r = await c.post("/v1/chat/completions", json=chat(),
                                     headers={"x-session-id": f"{tag}-{i}"})
                    assert r.status_code == 200, r.text
                    where.add(r.headers["x-gateway-replica"])
                return where

            # both instances route to both replicas, and each applies the other's facts
            applied = shared_b.applied
            assert await send(ca, 6, "a") == {first, second}
            await until("b applied a's facts", lambda: shared_b.applied >= applied + 6)
            applied = shared_a.applied
            assert await send(cb, 6, "b") == {first, second}
            await until("a applied b's facts", lambda: shared_a.applied >= applied + 6)

            # the second leaves a's answers first: a forgets it while b still routes to it
            answers["a"] = [HOSTS[0]]
            await until("a forgets the second", lambda: set(sa.fleet.replicas) == {first})
            assert second in await send(cb, 6, "late")
            # a Responses API answer b stored on it, as b's request path remembers one: the
            # last of b's late facts (the stream keeps their order), so a has read them all
            # once it has taken this one (remembered it, or skipped it as it should)
            sb.affinity.remember("resp_late", second)

            def skipped() -> float:
                return sa.metrics.registry.get_sample_value(
                    "gateway_shared_facts_total",
                    {"direction": "in", "result": "unknown_replica"}) or 0.0

            await until("a read b's late facts", lambda: skipped() >= 1
                        or sa.affinity.lookup("resp_late") is not None)
            assert sa.affinity.lookup("resp_late") is None
            assert names_held(sa, [second]) == []

            answers["b"] = [HOSTS[0]]
            # its departure is itself a fact b publishes (gateway/shared/departures.py): held
            # in b's outgoing queue until the next flush, then nothing names the second
            await until("b forgets the second and publishes it", lambda: set(
                sb.fleet.replicas) == {first} and not sb.shared._queue)
            assert names_held(sb, [second]) == []

            # afterwards both go on sharing facts about the first only
            applied = shared_a.applied
            assert await send(cb, 4, "after") == {first}
            await until("a applied b's facts", lambda: shared_a.applied >= applied + 4)
            assert await send(ca, 4, "after-a") == {first}
            assert names_held(sa, [second]) == []
            assert names_held(sb, [second]) == []
