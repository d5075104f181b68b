"""A replica that leaves the fleet while its probe, scrape, model refresh or a request is in
flight, in the app with an in-memory upstream: nothing raised, no ERROR logged, and nothing
of its name left in any map the services hold (`names_held` walks them all, so a new map
that forgets to drop a departed replica fails here). The pure parts: test_fleet_departure.py."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest

from gateway.admission.config import AdmissionConfig
from gateway.proxy.app import GatewayApp
from gateway.proxy.services import Services
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from tests.held_names import names_held
from tests.proxy_fakes import COMPLETION, JSON_H, MODEL, chat
from tests.upstream_double import MockReply, MockRequest, MockUpstream

# -- leaving while something is in flight ---------------------------------------------------

class Blocking:
    """Replicas a and b behind a MockUpstream; the request to `replica` for `path` waits
    for `release` (`reached` is set when it came)."""

    def __init__(self) -> None:
        self.block: tuple[str, str] | None = None
        self.reached = asyncio.Event()
        self.release = asyncio.Event()
        self.upstream = MockUpstream(self.handle)

    async def handle(self, req: MockRequest) -> MockReply:
        replica = req.url.split("//")[1].split(".")[0]
        path = req.url.split(".test", 1)[1]
        if self.block == (replica, path):
            self.reached.set()
            await self.release.wait()
        if path == "/health":
            return MockReply(200, JSON_H, [b""])
        if path == "/v1/models":
            return MockReply(200, JSON_H, [orjson.dumps({"object": "list", "data": [
                {"id": MODEL, "object": "model"}]})])
        if path == "/metrics":
            return MockReply(200, [("content-type", "text/plain")], [
                b"vllm:num_requests_waiting 0\nvllm:num_requests_running 1\n"
                b"vllm:kv_cache_usage_perc 0.5\nprocess_start_time_seconds 1000\n"])
        return MockReply(200, JSON_H, [COMPLETION])


def _settings() -> Settings:
    replicas = tuple(ReplicaSettings(name=n, url=f"http://{n}.test") for n in ("a", "b"))
    # the loops' own timers never fire here: each step is run by the test
    return Settings(replicas=replicas, server=ServerSettings(health_interval_s=3600,
                                                             models_refresh_s=3600),
                    usage=UsageConfig(startup_probe=False, scrape_interval_s=3600),
                    admission=AdmissionConfig(enabled=True))  # its per-replica state too


async def _assert_gone(app: GatewayApp, client: httpx.AsyncClient, name: str) -> None:
    services = app.services
    assert services is not None
    assert name not in services.fleet.replicas
    text = (await client.get("/metrics")).text
    assert f'replica="{name}"' not in text
    assert 'gateway_replica_healthy{replica="b"} 1.0' in text
    assert names_held(services, [name]) == []


async def _step(services: Services, what: str) -> None:
    monitor = services.monitor
    replica = services.fleet.replicas["a"]
    if what == "probe":
        await monitor.probe_all()
    elif what == "scrape":
        await monitor.scrape_all()
    elif what == "models":
        await monitor.refresh_models()
    elif what == "details":
        await monitor.probe_details(replica, services.recorder)
    else:  # "up": the first good probe after down reads models and metrics at once
        replica.healthy = False
        replica.failures = 1
        await monitor.probe(replica)


IN_FLIGHT = [("probe", "/health"), ("scrape", "/metrics"), ("models", "/v1/models"),
             ("up", "/v1/models"), ("up", "/metrics"), ("details", "/v1/completions")]


@pytest.mark.parametrize(("step", "path"), IN_FLIGHT, ids=[f"{s} {p}" for s, p in IN_FLIGHT])
async def test_a_replica_leaving_while_the_monitor_waits_on_it(
        step: str, path: str, caplog: pytest.LogCaptureFixture) -> None:
    fake = Blocking()
    app = GatewayApp(_settings(), upstream=fake.upstream)
    caplog.set_level(logging.INFO)
    async with app.running():
        services = app.services
        assert services is not None
        # a's own history: a request served, so every per-replica map holds it
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for _ in range(4):
                assert (await client.post("/v1/chat/completions", json=chat())).status_code \
                    == 200
            assert 'replica="a"' in (await client.get("/metrics")).text
            fake.block = ("a", path)
            task = asyncio.create_task(_step(services, step))
            async with asyncio.timeout(10):
                await fake.reached.wait()
            assert services.remove_replica("a") is not None
            fake.release.set()
            async with asyncio.timeout(10):
                await task
            await _assert_gone(app, client, "a")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_replica_leaving_while_a_request_is_on_it(
        caplog: pytest.LogCaptureFixture) -> None:
    fake = Blocking()
    app = GatewayApp(_settings(), upstream=fake.upstream)
    caplog.set_level(logging.INFO)
    async with app.running():
        services = app.services
        assert services is not None
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            fake.block = ("a", "/v1/chat/completions")
            sent = [asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
                    for _ in range(4)]  # the router spreads them: some go to a
            async with asyncio.timeout(10):
                await fake.reached.wait()
            services.remove_replica("a")
            fake.release.set()
            async with asyncio.timeout(10):
                statuses = [(await t).status_code for t in sent]
            assert statuses == [200] * 4
            await _assert_gone(app, client, "a")
            # what it served is counted, under "departed"
            text = (await client.get("/metrics")).text
            assert 'gateway_requests_total{model="m1",replica="departed"' in text
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


TAKEN = [("probe", "/health"), ("scrape", "/metrics"), ("models", "/v1/models")]


@pytest.mark.parametrize(("step", "path"), TAKEN, ids=[s for s, _ in TAKEN])
async def test_a_late_answer_never_reaches_the_replica_that_took_the_name(
        step: str, path: str) -> None:
    fake = Blocking()
    app = GatewayApp(_settings(), upstream=fake.upstream)
    async with app.running():
        services = app.services
        assert services is not None
        monitor = services.monitor
        fake.block = ("a", path)
        old = services.fleet.replicas["a"]
        old.failures = 2  # it failed before: a late good answer would clear that
        run = {"probe": monitor.probe, "scrape": monitor.scrape,
               "models": monitor.refresh_model}[step]
        task = asyncio.create_task(run(old))
        async with asyncio.timeout(10):
            await fake.reached.wait()
        services.remove_replica("a")
        new = services.fleet.add(ReplicaSettings(name="a", url="http://a.test"))
        new.failures = 2
        fake.release.set()
        async with asyncio.timeout(10):
            await task
        assert (new.healthy, new.failures, new.snapshot, new.start_time, new.models,
                new.model_cards) == (False, 2, None, None, None, ())


@pytest.mark.parametrize("step", ["probe", "scrape", "models", "details"])
async def test_a_step_begun_after_the_replica_left_sends_nothing(
        step: str, caplog: pytest.LogCaptureFixture) -> None:
    """A round takes its list of replicas before it starts: one that left meanwhile gets no
    request (the client pool would keep its origin again) and no error."""
    fake = Blocking()
    app = GatewayApp(_settings(), upstream=fake.upstream)
    async with app.running():
        services = app.services
        assert services is not None
        monitor = services.monitor
        old = services.fleet.replicas["a"]
        services.remove_replica("a")
        sent = len(fake.upstream.requests)
        if step == "details":
            await monitor.probe_details(old, services.recorder)
        else:
            await {"probe": monitor.probe, "scrape": monitor.scrape,
                   "models": monitor.refresh_model}[step](old)
        assert fake.upstream.requests[sent:] == []
        assert names_held(services, ["a"]) == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_suspect_run_and_stored_responses_go_with_the_replica() -> None:
    fake = Blocking()
    app = GatewayApp(_settings(), upstream=fake.upstream)
    async with app.running():
        services = app.services
        assert services is not None
        services.affinity.remember("resp_1", "a")  # a Responses API answer stored on a
        fake.block = ("a", "/health")
        services.monitor.suspect(services.fleet.replicas["a"])  # a request found it away
        async with asyncio.timeout(10):
            await fake.reached.wait()
        services.remove_replica("a")
        assert names_held(services, ["a"]) == []
        assert services.affinity.lookup("resp_1") is None
        fake.release.set()
