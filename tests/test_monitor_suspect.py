"""A suspect replica (a request could not be delivered to it) gets one quick probe run at a
time, however many requests fail there meanwhile (FleetMonitor.suspect), in process
against a MockUpstream whose health check the test holds open."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.proxy.app import create_app
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from tests.upstream_double import MockReply, MockRequest, MockUpstream

JSON_H = [("content-type", "application/json")]


class Replica:
    """Answers everything; while `held`, its health checks wait for `release`."""

    def __init__(self) -> None:
        self.health_calls = 0
        self.held = False
        self.release = asyncio.Event()

    async def handle(self, req: MockRequest) -> MockReply:
        if req.url.endswith("/health"):
            self.health_calls += 1
            if self.held:
                await self.release.wait()
            return MockReply(200, JSON_H, [b""])
        if req.url.endswith("/v1/models"):
            return MockReply(200, JSON_H, [b'{"object":"list","data":[{"id":"m"}]}'])
        return MockReply(404, JSON_H, [b"{}"])


async def until(cond: Callable[[], bool], what: str, deadline_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not cond():
        assert loop.time() < end, f"not within {deadline_s} s: {what}"
        await asyncio.sleep(0.001)


async def test_one_suspect_probe_run_per_replica_at_a_time() -> None:
    replica = Replica()
    settings = Settings(
        replicas=(ReplicaSettings(name="r", url="http://r.test"),),
        server=ServerSettings(health_interval_s=3600),
        usage=UsageConfig(startup_probe=False, scrape_interval_s=3600))
    app = create_app(settings, upstream=MockUpstream(replica.handle))
    async with app.running():
        s = app.services
        assert s is not None
        r = s.fleet.replicas["r"]
        before = replica.health_calls  # the start-up probe round
        replica.held = True
        for _ in range(5):  # five requests failed there in a burst
            s.monitor.suspect(r)
        await until(lambda: replica.health_calls > before, "the suspect run probes")
        for _ in range(20):  # every task started now has reached its probe
            await asyncio.sleep(0)
        assert replica.health_calls == before + 1
        replica.release.set()  # it answers: the run ends, the replica stays up
        await until(lambda: not s.monitor._suspects, "the run ends")
        assert r.healthy
        s.monitor.suspect(r)  # a later failure starts a new run
        await until(lambda: replica.health_calls == before + 2, "a new run probes")
