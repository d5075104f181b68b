"""A replica whose name comes back at another address (a reloaded [[replicas]] url; a pod
recreated with a new IP) is another server: a request still in flight to the old address
gives back nothing to the new one when it ends (gateway.replicas.fleet Fleet.current,
gateway/proxy/flow.py finish). The routing half is the review's
tests/test_fleet_review37.py; here the admission count and the metric series."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx

from gateway.admission.config import AdmissionConfig
from gateway.proxy.app import GatewayApp
from gateway.settings import Settings, parse_settings
from tests.held_replica import Held
from tests.proxy_fakes import chat
from tests.test_fleet_sources_loopback import DEADLINE_S, settings, until


def _request_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("gateway_requests_total{")]


async def test_a_request_ending_at_a_replaced_address_frees_no_room_of_the_new_one(
        tmp_path: Path) -> None:
    """[admission] one request per replica. r1 runs at a's old address; a moves; r2 runs
    at the new one. When r1 ends, the new a's room is still r2's: r3 waits in the queue
    (not sent beside r2), and r1 is counted under `departed`, not under the new a."""
    old, new = Held(), Held()
    url_old, url_new = await old.start(), await new.start()
    path = tmp_path / "gateway.toml"
    base = dataclasses.replace(
        settings(grace_s=0.0),
        admission=AdmissionConfig(enabled=True, replica_max_in_flight=1))

    def write(url: str) -> None:
        path.write_text(f'[[replicas]]\nname = "a"\nurl = "{url}"\n')

    def reload() -> Settings:
        return dataclasses.replace(base, replicas=parse_settings(path.read_text(), {}).replicas)

    write(url_old)
    app = GatewayApp(reload(), reload=reload)
    try:
        async with app.running():
            services = app.services
            assert services is not None and services.gate is not None
            fleet, gate = services.fleet, services.gate
            await until("a up", lambda: bool(fleet.healthy()))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                         timeout=DEADLINE_S) as client:
                def send(i: int) -> asyncio.Task[httpx.Response]:
                    return asyncio.create_task(client.post(
                        "/v1/chat/completions", json=chat(user=f"u{i}")))

                r1 = send(1)
                await asyncio.wait_for(old.arrived.wait(), DEADLINE_S)
                write(url_new)
                assert await app.reload_settings()
                await until("the new a up", lambda: fleet.replicas["a"].url == url_new
                            and fleet.replicas["a"].healthy)
                r2 = send(2)
                await asyncio.wait_for(new.arrived.wait(), DEADLINE_S)
                old.release.set()
                assert (await asyncio.wait_for(r1, DEADLINE_S)).status_code == 200
                r3 = send(3)
                await until("r3 queued behind r2", lambda: gate._count == 1)
                assert new.chats == 1
                lines = _request_lines((await client.get("/metrics")).text)
                assert any('replica="departed"' in line for line in lines), lines
                assert not any('replica="a"' in line for line in lines), lines
                new.release.set()
                answers = [await asyncio.wait_for(t, DEADLINE_S) for t in (r2, r3)]
                assert [r.status_code for r in answers] == [200, 200]
                assert (old.chats, new.chats) == (1, 2)
    finally:
        old.release.set()
        new.release.set()
        await old.runner.cleanup()
        await new.runner.cleanup()
