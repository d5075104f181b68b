"""Token mode's KV-event feeds follow the fleet (gateway.events.feeds `add_replica`,
`remove_replica`): `gateway sim --kv-events` replicas that join through a DNS name (the
resolver seam) after start-up get their feed (discovered through `GET /kv_event_sources`,
subscribed, their events read), one that leaves and departs has its feed cancelled and
forgotten (its blocks out of the index, its entry out of /stats), and its feed is made
anew when it joins again."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx
import pytest

from gateway.events.config import TokenSettings
from gateway.proxy.app import GatewayApp
from gateway.serve import sim_renderer
from tests.servers import free_ports, sim
from tests.test_fleet_sources_loopback import settings, until

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

SUBSCRIBED = ("waiting for events", "live")


async def test_feeds_for_replicas_that_join_and_depart() -> None:
    kv_port = free_ports(4)
    with sim(2, ["--model", "sim", "--speed", "50", "--kv-events", "--kv-events-port",
                 str(kv_port), "--dev-mode"]) as urls:
        first, second = (u[len("http://"):] for u in urls)
        answers: dict[str, list[str]] = {"a.test": ["127.0.0.1"], "b.test": []}

        async def resolve(host: str, port: int) -> list[str]:
            return list(answers[host])

        base = settings(dns=(f"a.test:{first.rsplit(':')[1]}",
                             f"b.test:{second.rsplit(':')[1]}"),
                        dns_interval_s=0.05, grace_s=0.0)
        app = GatewayApp(dataclasses.replace(base, tokens=TokenSettings(models={"sim": "sim"})),
                         resolver=resolve, sim_renderer=sim_renderer)
        async with app.running(), httpx.AsyncClient(timeout=30) as client:
            services = app.services
            assert services is not None and services.feeds is not None
            feeds = services.feeds

            def replicas() -> dict[str, Any]:
                got: dict[str, Any] = feeds.status(services.clock())["replicas"]
                return got

            def state(name: str) -> str | None:
                entry = replicas().get(name)
                return None if entry is None else entry.get("state")

            async def events_flow(name: str) -> None:
                await until(f"{name} subscribed", lambda: state(name) in SUBSCRIBED)
                r = await client.post(f"http://{name}/v1/chat/completions", json={
                    "model": "sim", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hello " * 40}]})
                assert r.status_code == 200, r.text
                await until(f"{name} live", lambda: state(name) == "live")

            await events_flow(first)  # joined through DNS after the feeds started
            assert second not in replicas()

            answers["b.test"] = ["127.0.0.1"]
            await events_flow(second)
            task = feeds._tasks[second]
            assert feeds._index.held_blocks(second) > 0

            answers["b.test"] = []
            await until("the second departs", lambda: second not in services.fleet.replicas)
            await until("its feed ends", task.done)
            await asyncio.sleep(0)
            assert task.cancelled()
            assert second not in replicas()
            assert feeds._index.state(second) is None
            assert set(feeds._tasks) == {first}
            assert state(first) == "live"

            answers["b.test"] = ["127.0.0.1"]  # back: a feed of its own again
            await until("the second back", lambda: second in services.fleet.replicas)
            await until("a new feed", lambda: second in feeds._tasks)
            assert feeds._tasks[second] is not task
            await until("subscribed again", lambda: state(second) in SUBSCRIBED)
