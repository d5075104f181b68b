"""Busy is not down, and down is not forgotten (gateway.replicas.fleet / monitor), in process
against a MockUpstream driven by hand: probes alone mark a replica down, after
`unhealthy_after` failures in a row; a replica down keeps its routing memory (index,
bindings) and gets it back as it was, unless it is seen restarted (a new process start time
in /metrics) or was down longer than `forget_after_s`."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
import pytest

from gateway.proxy.app import GatewayApp, create_app
from gateway.replicas.fleet import memory_verdict, restarted
from gateway.replicas.scrape import parse_engine_metrics
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.upstream.errors import UpstreamTimeout
from gateway.usage.config import UsageConfig
from tests.upstream_double import MockReply, MockRequest, MockUpstream

JSON_H = [("content-type", "application/json")]
MODELS = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})
BODY = {"model": "m", "messages": [{"role": "user", "content": "a long shared prompt " * 80}]}


@dataclass
class Replica:
    """What the replica does now: `health` ("ok", "slow", "503"), its process start time."""

    health: str = "ok"
    started: float = 1000.0
    seen: list[str] = field(default_factory=list)

    async def handle(self, req: MockRequest) -> MockReply:
        path = req.url.split(".test", 1)[1]
        self.seen.append(path)
        if path == "/health":
            if self.health == "slow":
                raise UpstreamTimeout("no answer in time")
            return MockReply(200 if self.health == "ok" else 503, JSON_H, [b"{}"])
        if path == "/v1/models":
            return MockReply(200, JSON_H, [MODELS])
        if path == "/metrics":
            text = f"process_start_time_seconds {self.started}\nvllm:num_requests_running 0\n"
            return MockReply(200, [("content-type", "text/plain")], [text.encode()])
        return MockReply(404, JSON_H, [b"{}"])


class Clock:
    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now


def app_for(replica: Replica, clock: Clock) -> GatewayApp:
    settings = Settings(
        replicas=(ReplicaSettings(name="r", url="http://r.test", models=("m",)),),
        server=ServerSettings(health_interval_s=3600, forget_after_s=600),
        usage=UsageConfig(startup_probe=False, scrape_interval_s=3600))
    return create_app(settings, upstream=MockUpstream(replica.handle), clock=clock)


@pytest.mark.parametrize(("health", "after", "restart", "down_s", "kept"), [
    # what the probes met, the health when it came back, new process?, time down, kept?
    ("slow", "ok", False, 30.0, True),  # only slow: memory kept
    ("503", "ok", False, 30.0, True),
    ("slow", "ok", True, 30.0, False),  # restarted while down: cleared
    ("503", "ok", False, 601.0, False),  # down past forget_after_s: cleared
])
async def test_a_down_replica_keeps_its_memory_unless_restarted_or_gone_long(
    health: str, after: str, restart: bool, down_s: float, kept: bool
) -> None:
    replica, clock = Replica(), Clock()
    app = app_for(replica, clock)
    async with app.running():
        s = app.services
        assert s is not None
        fleet, router, monitor = s.fleet, s.router, s.monitor
        plan = router.decide(BODY, "chat", "m", None, [fleet.replicas["r"].state()], clock())
        plan.outcome.first_token_at = clock()
        plan.outcome.ok, plan.outcome.prompt_tokens = True, 200
        router.report(plan, clock())
        held = router.indexed_blocks("r")
        assert held > 0
        replica.health = health
        for _ in range(fleet.unhealthy_after):
            assert fleet.replicas["r"].healthy  # not down before N failures in a row
            await monitor.probe(fleet.replicas["r"])
        assert not fleet.replicas["r"].healthy
        assert router.indexed_blocks("r") == held  # down is routed around, not forgotten
        clock.now += down_s
        replica.health = after
        if restart:
            replica.started += 5.0
        await monitor.probe(fleet.replicas["r"])
        assert fleet.replicas["r"].healthy
        assert router.indexed_blocks("r") == (held if kept else 0)


async def test_a_restart_between_probes_is_seen_after_one_failed_probe() -> None:
    replica, clock = Replica(), Clock()
    app = app_for(replica, clock)
    async with app.running():
        s = app.services
        assert s is not None
        plan = s.router.decide(BODY, "chat", "m", None, [s.fleet.replicas["r"].state()],
                               clock())
        plan.outcome.first_token_at = clock()
        s.router.report(plan, clock())
        assert s.router.indexed_blocks("r") > 0
        replica.health = "503"
        await s.monitor.probe(s.fleet.replicas["r"])  # one failure: still up
        replica.health, replica.started = "ok", replica.started + 60
        await s.monitor.probe(s.fleet.replicas["r"])  # back: /metrics read at once
        assert s.fleet.replicas["r"].healthy and s.router.indexed_blocks("r") == 0


@pytest.mark.parametrize(("text", "value"), [
    ("process_start_time_seconds 1.7e9\n", 1.7e9),
    ("# HELP process_start_time_seconds x\nprocess_start_time_seconds 12.5\n", 12.5),
    ('process_start_time_seconds{pid="1"} 3\n', 3.0),
    ("vllm:num_requests_running 1\n", None),
    ("process_start_time_seconds NaN\n", None),
    ("process_start_time_seconds_x 4\n", None),
])
def test_process_start_time(text: str, value: float | None) -> None:
    assert parse_engine_metrics(text, 0.0).process_start_time_seconds == value


@pytest.mark.parametrize(("known", "seen", "fresh"), [
    (None, 5.0, False), (5.0, None, False), (5.0, 5.0, False), (5.0, 6.0, True),
])
def test_restarted(known: float | None, seen: float | None, fresh: bool) -> None:
    assert restarted(known, seen) is fresh


@pytest.mark.parametrize(("down_since", "now", "forget", "clear"), [
    (None, 100.0, 10.0, False), (95.0, 100.0, 10.0, False), (89.0, 100.0, 10.0, True),
])
def test_memory_verdict(down_since: float | None, now: float, forget: float,
                        clear: bool) -> None:
    assert memory_verdict(down_since, now, forget) is clear
