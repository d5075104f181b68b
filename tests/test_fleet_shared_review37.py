"""Outside review of issue 37 with instances sharing Redis (a real redis-server): a gateway
instance that starts while others run replays the routing facts of the last replay_s
(gateway/shared/redis_state.py catch_up), so it routes on what they learned. Whether its
fleet comes from [[replicas]] or from a DNS name must make no difference."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from gateway.proxy.app import GatewayApp
from gateway.routing.config import RoutingConfig
from gateway.settings import ReplicaSettings
from gateway.shared.config import RedisSettings
from tests.held_replica import predicted
from tests.proxy_fakes import chat
from tests.redis_server import needs_redis, redis_server
from tests.servers import free_port
from tests.test_fleet_sources_loopback import HOSTS, pods, port_on_every_host, settings, until

pytest.importorskip("redis")


@needs_redis
@pytest.mark.parametrize("source", ["static", "dns"])
async def test_an_instance_started_later_replays_what_the_others_learned(
        source: str) -> None:
    """Found (source="dns"): GatewayApp.startup (gateway/proxy/app.py) catches up with the
    stream (start_shared_state) before `FleetSources.start` has resolved the DNS name: the
    fleet is empty then, `Router.apply` skips every fact about a replica it does not know,
    and the instance starts with no routing memory (the same for a label selector's pods).
    "static" is the control: the same replicas from [[replicas]] are replayed."""
    port, redis_port = port_on_every_host(), free_port()
    names = [f"{h}:{port}" for h in HOSTS[:2]]

    async def resolve(host: str, asked: int) -> list[str]:
        return list(HOSTS[:2])

    base = dataclasses.replace(
        settings(grace_s=0.0), routing=RoutingConfig(),
        redis=RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0"))
    if source == "dns":
        base = dataclasses.replace(base, discovery=dataclasses.replace(
            base.discovery, dns=(f"vllm.test:{port}",), dns_interval_s=0.05))
    else:
        base = dataclasses.replace(base, replicas=tuple(
            ReplicaSettings(name=n, url=f"http://{n}") for n in names))
    first = GatewayApp(base, resolver=resolve)
    body = chat(messages=[{"role": "user", "content": "the shared prefix " * 40}])
    with redis_server(redis_port):
        async with pods() as pool:
            for h in HOSTS[:2]:
                await pool.start(h, port)
            async with first.running():
                sa = first.services
                assert sa is not None
                await until("both up on the first", lambda: len(sa.fleet.healthy()) == 2)
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=first),
                                             base_url="http://gw", timeout=30) as ca:
                    r = await ca.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200
                    served = r.headers["x-gateway-replica"]
                    r = await ca.post("/v1/chat/completions", json=body)
                    assert predicted(r) > 0  # the first learned it
                later = GatewayApp(base, resolver=resolve)
                async with later.running():
                    sb = later.services
                    assert sb is not None
                    await until("both up on the later", lambda: len(sb.fleet.healthy()) == 2)
                    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=later),
                                                 base_url="http://gw", timeout=30) as cb:
                        r = await cb.post("/v1/chat/completions", json=body)
                        assert r.status_code == 200
                        assert (r.headers["x-gateway-replica"], predicted(r) > 0) == (
                            served, True), r.headers.get("x-gateway-cache")
