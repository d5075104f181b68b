"""With [redis], a gateway whose replicas come from a DNS name replays the others' facts
only once the router knows those replicas (Router.apply skips the rest): start-up
resolves the name and waits for the joiners' first probes (bounded,
gateway/proxy/app.py CATCH_UP_JOIN_WAIT_S) before the catch-up. The end-to-end case is
the review's tests/test_fleet_shared_review37.py; this one checks the order itself, which
a fast loopback join could otherwise win by chance."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.proxy import app as app_module
from gateway.proxy.app import GatewayApp
from gateway.shared.config import RedisSettings
from tests.redis_server import needs_redis, redis_server
from tests.servers import free_port
from tests.test_fleet_sources_loopback import HOSTS, pods, port_on_every_host, settings

pytest.importorskip("redis")


@needs_redis
async def test_the_catch_up_starts_once_the_dns_replicas_are_known(
        monkeypatch: pytest.MonkeyPatch) -> None:
    port, redis_port = port_on_every_host(), free_port()
    names = sorted(f"{h}:{port}" for h in HOSTS[:2])

    async def resolve(host: str, asked: int) -> list[str]:
        return list(HOSTS[:2])

    known_at_catch_up: list[list[str]] = []
    real = app_module.start_shared_state

    async def start_shared_state(settings: Any, router: Any, services: Any, metrics: Any,
                                 clock: Any) -> Any:
        known_at_catch_up.append([n for n in names if n in router._ledger.limits])
        return await real(settings, router, services, metrics, clock)

    monkeypatch.setattr(app_module, "start_shared_state", start_shared_state)
    base = dataclasses.replace(
        settings(grace_s=0.0), redis=RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0"))
    base = dataclasses.replace(base, discovery=dataclasses.replace(
        base.discovery, dns=(f"vllm.test:{port}",)))
    with redis_server(redis_port):
        async with pods() as pool:
            for h in HOSTS[:2]:
                await pool.start(h, port)
            async with GatewayApp(base, resolver=resolve).running():
                pass
    assert known_at_catch_up == [names]
