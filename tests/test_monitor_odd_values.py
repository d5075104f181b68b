"""The monitor cannot die, on loopback: the gateway app under uvicorn, its real aiohttp
upstreams, two raw replicas on 127.0.0.1. One's `/metrics` carries `inf`, `nan`, `1e308`
(and worse) in `cache_config_info` labels and in sample values (before the fix `int(float
("inf"))` raised: the gateway refused to start, later every replica's scrape loop died).
The gateway starts, routes to both, and keeps probing and scraping both: each replica
counts the probes and scrapes it receives, and the test waits (bounded) for more of each.
In process, against a MockUpstream: a replica whose `/health` or `/metrics` raises an
error the transport never should is a failed probe (marked down, not a dead health loop)
or a scrape failure logged against that replica, and the other replica is monitored as
usual."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
import uvicorn

from gateway.proxy.app import GatewayApp, create_app
from gateway.routing.config import RoutingConfig
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from tests.recording_replica import MODELS, completion, response
from tests.test_fault_hang import InProcessServer, free_port
from tests.upstream_double import MockReply, MockRequest, MockUpstream

ODD_METRICS = b"""# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="inf",num_gpu_blocks="1e308"} 1.0
vllm:cache_config_info{block_size="nan",num_gpu_blocks="-inf"} 1.0
vllm:cache_config_info{block_size="1e308",num_gpu_blocks="nan"} NaN
vllm:num_requests_running inf
vllm:num_requests_waiting nan
vllm:kv_cache_usage_perc 1e308
vllm:prefix_cache_queries_total -inf
vllm:prefix_cache_hits_total 1e308
vllm:prompt_tokens_total 1e308
vllm:generation_tokens_total %s
process_start_time_seconds inf
vllm:num_requests_running{engine="1"} 1e308
""" % (b"1" * 330)  # an integer float() cannot hold
PLAIN_METRICS = (b'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n'
                 b"vllm:num_requests_running 0\nprocess_start_time_seconds 1.7e9\n")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


class Replica:
    """Answers probes, models, /metrics (its own text) and chat; counts each path."""

    def __init__(self, metrics: bytes) -> None:
        self.metrics = metrics
        self.seen: Counter[str] = Counter()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for h in head.split(b"\r\n")[1:]:
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                path = head.split(b" ", 2)[1].decode()
                self.seen[path] += 1
                if path == "/metrics":
                    writer.write(response("200 OK", self.metrics, b"text/plain"))
                elif path == "/v1/models":
                    writer.write(response("200 OK", MODELS))
                elif path == "/v1/chat/completions":
                    writer.write(response("200 OK", completion("fine")))
                else:
                    writer.write(response("200 OK", b"{}"))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(replicas: dict[str, Replica]) -> AsyncIterator[tuple[str, GatewayApp]]:
    settings = Settings(
        replicas=tuple(ReplicaSettings(name=n, url=f"http://127.0.0.1:{r.port}", models=("m",))
                       for n, r in replicas.items()),
        server=ServerSettings(health_interval_s=0.05, health_timeout_s=2.0,
                              models_refresh_s=0.05),
        routing=RoutingConfig(policy="round_robin"),
        usage=UsageConfig(startup_probe=False, scrape_interval_s=0.05))
    app = create_app(settings)
    port = free_port()
    srv = InProcessServer(uvicorn.Config(app, host="127.0.0.1", port=port, loop="none",
                                         lifespan="on", log_config=None, access_log=False))
    task = asyncio.create_task(srv.serve())
    deadline = time.monotonic() + 20
    while not srv.started:
        assert not task.done(), "the gateway did not start"
        assert time.monotonic() < deadline, "the gateway did not start in time"
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        srv.should_exit = True
        await asyncio.wait_for(task, 10)


async def until(done: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def test_odd_metrics_values_stop_no_monitoring() -> None:
    replicas = {"odd": Replica(ODD_METRICS), "plain": Replica(PLAIN_METRICS)}
    for r in replicas.values():
        await r.start()
    try:
        async with serving(replicas) as (url, app), httpx.AsyncClient(timeout=10) as client:
            assert app.services is not None
            ready = (await client.get(url + "/ready")).json()
            assert ready == {"ready": True, "healthy": ["odd", "plain"]}
            served = Counter()
            for _ in range(4):  # round robin: both replicas answer
                r = await client.post(url + "/v1/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text
                served[r.headers["x-gateway-replica"]] += 1
            assert served == {"odd": 2, "plain": 2}
            # Probes and scrapes keep arriving at both, round after round.
            for path in ("/health", "/metrics", "/v1/models"):
                before = {n: r.seen[path] for n, r in replicas.items()}
                await until(lambda p=path, b=before: all(  # type: ignore[misc]
                    r.seen[p] >= b[n] + 5 for n, r in replicas.items()))
            odd = app.services.fleet.replicas["odd"].snapshot
            assert odd is not None  # scraped, with every odd figure read as none
            assert (odd.num_requests_running, odd.kv_cache_usage, odd.capacity_tokens,
                    odd.process_start_time_seconds) == (None, None, None, None)
            stats = (await client.get(url + "/stats")).json()
            assert stats["replicas"]["plain"]["capacity_tokens"] == 16_000
            metrics = await client.get(url + "/metrics")
            assert metrics.status_code == 200
            assert app.services.monitor.failures.failures == 0  # nothing reached the boundary
    finally:
        for r in replicas.values():
            await r.stop()


# In process: errors the transport never should raise ----------------------------------

JSON_H = [("content-type", "application/json")]


def mock_fleet(broken: str, now: bool = True) -> tuple[MockUpstream, Counter[str]]:
    """Replicas "bad" and "good"; bad's `broken` path raises once `seen["broken"]` is set
    (at once with `now`)."""
    seen: Counter[str] = Counter({"broken": int(now)})

    async def handle(req: MockRequest) -> MockReply:
        host, path = req.url.removeprefix("http://").split(".test", 1)
        seen[f"{host} {path}"] += 1
        if host == "bad" and path == broken and seen["broken"]:
            raise RuntimeError("a transport bug")
        if path == "/v1/models":
            return MockReply(200, JSON_H, [MODELS])
        if path == "/metrics":
            return MockReply(200, [("content-type", "text/plain")], [PLAIN_METRICS])
        return MockReply(200, JSON_H, [b"{}"])

    return MockUpstream(handle), seen


def mock_app(upstream: MockUpstream) -> GatewayApp:
    settings = Settings(
        replicas=tuple(ReplicaSettings(name=n, url=f"http://{n}.test", models=("m",))
                       for n in ("bad", "good")),
        server=ServerSettings(health_interval_s=0.02, models_refresh_s=3600,
                              unhealthy_after=1),
        usage=UsageConfig(startup_probe=False, scrape_interval_s=0.02))
    return create_app(settings, upstream=upstream)


@pytest.mark.parametrize("at_start", [True, False])
async def test_a_probe_that_raises_is_a_failed_probe(at_start: bool) -> None:
    upstream, seen = mock_fleet("/health", now=at_start)
    app = mock_app(upstream)
    async with app.running():
        s = app.services
        assert s is not None
        up = {r.name for r in s.fleet.healthy()}
        assert up == ({"good"} if at_start else {"bad", "good"})  # started all the same
        seen["broken"] = 1
        await until(lambda: not s.fleet.replicas["bad"].healthy)  # marked down
        before = dict(seen)
        await until(lambda: all(seen[k] >= before.get(k, 0) + 5
                                for k in ("bad /health", "good /health", "good /metrics")))
        assert [r.name for r in s.fleet.healthy()] == ["good"]


async def test_a_scrape_that_raises_is_logged_against_its_replica(
        caplog: pytest.LogCaptureFixture) -> None:
    upstream, seen = mock_fleet("/metrics")
    app = mock_app(upstream)
    with caplog.at_level(logging.ERROR, logger="gateway.replicas"):
        async with app.running():
            s = app.services
            assert s is not None
            before = dict(seen)
            await until(lambda: all(seen[k] >= before.get(k, 0) + 5 for k in (
                "bad /metrics", "good /metrics", "bad /health", "good /health")))
            assert {r.name for r in s.fleet.healthy()} == {"bad", "good"}
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("scrape bad failed (RuntimeError)") for m in logged), logged
    assert len([m for m in logged if m.startswith("scrape bad")]) == 1  # rate-limited
    # Caught per replica, never as the failure of a whole round.
    assert not any(m.startswith("scrapes failed") for m in logged), logged


@pytest.mark.parametrize("body", [
    b'{"data": [{"id": 1e999}]}', b'{"data": [{"id": NaN}]}', b"[" * 100_000, b"[]",
    b'{"data": "m"}', b'{"data": [1, null, {"id": 5}, {"id": ["m"]}]}', b"\xff\xfe",
    b'{"data": [{"id": "m", "max_model_len": 1e308}]}',
])
async def test_any_models_answer_is_read_without_raising(body: bytes) -> None:
    async def handle(req: MockRequest) -> MockReply:
        path = req.url.split(".test", 1)[1]
        if path == "/v1/models":
            return MockReply(200, JSON_H, [body])
        return MockReply(200, JSON_H, [b"{}"])

    settings = Settings(
        replicas=(ReplicaSettings(name="r", url="http://r.test"),),
        server=ServerSettings(health_interval_s=3600, models_refresh_s=3600),
        usage=UsageConfig(startup_probe=False, scrape_interval_s=3600))
    app = create_app(settings, upstream=MockUpstream(handle))
    async with app.running():
        s = app.services
        assert s is not None
        await s.monitor.refresh_models()  # raises nothing, logs nothing
        assert s.monitor.failures.failures == 0
        assert s.fleet.replicas["r"].models in (None, frozenset(), frozenset({"m"}))
