"""The fleet monitor in process, against a MockUpstream: which capacity reaches the router
(engine-reported, configured, default) whatever the replica's /metrics does, and what
/stats says about it."""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pytest

from gateway.app import create_app
from gateway.errors import UpstreamConnectError
from gateway.mock_upstream import MockReply, MockRequest, MockUpstream
from gateway.routing.config import RoutingConfig
from gateway.settings import ReplicaSettings, Settings

JSON_H = [("content-type", "application/json")]
TEXT_H = [("content-type", "text/plain")]
MODELS = orjson.dumps({"object": "list", "data": [{"id": "m1", "object": "model"}]})
# 1000 blocks x 16 tokens, as vLLM exports it
ENGINE_METRICS = (b'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n'
                  b"vllm:num_requests_running 0.0\n")
CONFIGURED = 3000
DEFAULT = 100_000

MetricsReply = Callable[[], MockReply]


def metrics_404() -> MockReply:
    return MockReply(404, JSON_H, [b'{"detail":"Not Found"}'])


def metrics_refused() -> MockReply:
    raise UpstreamConnectError("connection refused")


def metrics_without_info() -> MockReply:
    return MockReply(200, TEXT_H, [b"vllm:num_requests_running 0.0\n"])


def metrics_with_info() -> MockReply:
    return MockReply(200, TEXT_H, [ENGINE_METRICS])


def upstream(metrics: MetricsReply) -> MockUpstream:
    async def handle(req: MockRequest) -> MockReply:
        path = req.url.split(".test", 1)[1]
        if path == "/health":
            return MockReply(200, JSON_H, [b""])
        if path == "/v1/models":
            return MockReply(200, JSON_H, [MODELS])
        if path == "/metrics":
            return metrics()
        return MockReply(404, JSON_H, [b"{}"])

    return MockUpstream(handle)


def settings(capacity: int | None) -> Settings:
    return Settings(
        replicas=(ReplicaSettings(name="a", url="http://a.test", capacity_tokens=capacity),),
        routing=RoutingConfig(default_capacity_tokens=DEFAULT),
    )


def blocks(tokens: int) -> int:
    """The router's index size for a capacity (bytes/token 4 before any usage, 64-byte blocks)."""
    return tokens * 4 // 64


@pytest.mark.parametrize(("metrics", "capacity", "tokens", "source"), [
    (metrics_404, CONFIGURED, CONFIGURED, "config"),  # llama.cpp without --metrics
    (metrics_refused, CONFIGURED, CONFIGURED, "config"),
    (metrics_without_info, CONFIGURED, CONFIGURED, "config"),  # llama.cpp with --metrics
    (metrics_with_info, CONFIGURED, 16_000, "engine"),  # the engine's own figure wins
    (metrics_404, None, DEFAULT, "default"),
    (metrics_with_info, None, 16_000, "engine"),
], ids=["404", "refused", "no-info", "engine", "404-default", "engine-default"])
async def test_capacity_reaches_the_router_and_stats(
    metrics: MetricsReply, capacity: int | None, tokens: int, source: str,
) -> None:
    app = create_app(settings(capacity), upstream=upstream(metrics))
    async with app.running():
        assert app.services is not None
        s = app.services
        assert s.router.index_limit("a") == blocks(tokens)
        await s.monitor.scrape_all()  # a later scrape keeps it
        assert s.router.index_limit("a") == blocks(tokens)
        status, body, _ = app._simple_get(s, "/stats") or (0, b"", b"")
        assert status == 200
        rep = orjson.loads(body)["replicas"]["a"]
        assert (rep["capacity_tokens"], rep["capacity_source"]) == (tokens, source)
