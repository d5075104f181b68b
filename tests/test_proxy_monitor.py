"""The fleet monitor in process, against a MockUpstream: which capacity reaches the router
(engine-reported, configured, default) whatever the replica's /metrics does, and what
/stats says about it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import orjson
import pytest

from gateway.proxy.app import create_app
from gateway.proxy.errors import UpstreamConnectError
from gateway.routing.config import RoutingConfig
from gateway.settings import ReplicaSettings, Settings
from gateway.usage.config import UsageConfig
from tests.upstream_double import MockReply, MockRequest, MockUpstream

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
        usage=UsageConfig(startup_probe=False),
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
        rep = app.stats(s)["replicas"]["a"]
        assert (rep["capacity_tokens"], rep["capacity_source"]) == (tokens, source)


# start-up probe for cached_tokens reporting ------------------------------------------------

def completion(details: bool) -> MockReply:
    usage: dict[str, object] = {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}
    if details:
        usage["prompt_tokens_details"] = {"cached_tokens": 32}
    body = {"object": "text_completion", "choices": [{"index": 0, "text": "x"}], "usage": usage}
    return MockReply(200, JSON_H, [orjson.dumps(body)])


@pytest.mark.parametrize(("answers", "probes", "reports"), [
    ([False, False], 2, False),  # vLLM without --enable-prompt-tokens-details
    ([False, True], 2, True),  # vLLM <= 0.23 with it: details only on the cache hit
    ([True], 1, True),  # vLLM >= 0.24 with it: details (cached 0) from the first answer
    ([None, None], 2, None),  # the completions failed: no verdict
], ids=["missing", "second-only", "first", "failed"])
async def test_startup_probe_marks_replicas_without_cached_tokens(
    answers: list[bool | None], probes: int, reports: bool | None,
) -> None:
    sent: list[MockRequest] = []
    base = upstream(metrics_404)

    async def handle(req: MockRequest) -> MockReply:
        if not req.url.endswith("/v1/completions"):
            return await base.handler(req)
        sent.append(req)
        answer = answers[len(sent) - 1]
        return MockReply(500, JSON_H, [b"{}"]) if answer is None else completion(answer)

    app = create_app(dataclasses.replace(settings(None), usage=UsageConfig()),
                     upstream=MockUpstream(handle))
    async with app.running():
        assert app.services is not None
        s = app.services
        for _ in range(200):  # the probe runs in the background
            if not s.monitor._details_probes:
                break
            await asyncio.sleep(0.005)
        stats = s.recorder.stats(0.0, {"a": None})
    assert len(sent) == probes
    assert orjson.loads(sent[0].body or b"")["max_tokens"] == 1
    assert stats["replicas"]["a"]["reports_cached_tokens"] is reports
    warned = any("--enable-prompt-tokens-details" in w for w in stats["warnings"])
    assert warned is (reports is False)
    assert stats["windows"]["all"]["requests"] == 0  # probes are not client requests
