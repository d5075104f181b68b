"""Every probe and scrape of the monitor is bounded in bytes and in time, whatever a replica
does (in process, against a MockUpstream; the real client's own timeouts on a socket are
tests/test_monitor_drip.py's):

- a `/metrics` larger than `MAX_PROBE_BYTES` is a failed scrape, logged against its
  replica, never parsed (before: read up to 64 MiB and parsed on the event loop, several
  seconds of ~10 us a line during which no request was routed and no other replica probed);
- a replica whose `/metrics`, `/health` or `/v1/models` never answers (a step that hangs
  rather than raises) holds its own step up at most the monitor's deadline: the other
  replica is probed, scraped and refreshed as usual, and a hanging `/health` is a failed
  probe (before: the round's gather waited for ever and the loop of every replica stopped).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import pytest

from gateway.proxy.app import GatewayApp, create_app
from gateway.replicas.monitor import MAX_PROBE_BYTES
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from tests.recording_replica import MODELS
from tests.test_monitor_odd_values import PLAIN_METRICS, until
from tests.upstream_double import MockReply, MockRequest, MockUpstream

JSON_H = [("content-type", "application/json")]
TEXT_H = [("content-type", "text/plain")]
LINE = b'vllm:num_requests_running{engine="0"} 1\n'


def fleet(bad_path: str, bad: MockReply | None) -> tuple[MockUpstream, Counter[str]]:
    """Replicas "bad" and "good"; bad's `bad_path` answers `bad`, or never (None)."""
    seen: Counter[str] = Counter()

    async def handle(req: MockRequest) -> MockReply:
        host, path = req.url.removeprefix("http://").split(".test", 1)
        seen[f"{host} {path}"] += 1
        if host == "bad" and path == bad_path and seen["hang"]:
            if bad is None:
                await asyncio.Event().wait()  # never answers
            else:
                return bad
        if path == "/v1/models":
            return MockReply(200, JSON_H, [MODELS])
        if path == "/metrics":
            return MockReply(200, TEXT_H, [PLAIN_METRICS])
        return MockReply(200, JSON_H, [b"{}"])

    return MockUpstream(handle), seen


def app_for(upstream: MockUpstream) -> GatewayApp:
    settings = Settings(
        replicas=tuple(ReplicaSettings(name=n, url=f"http://{n}.test", models=("m",))
                       for n in ("bad", "good")),
        server=ServerSettings(health_interval_s=0.02, health_timeout_s=0.1,
                              models_refresh_s=0.02, unhealthy_after=1),
        usage=UsageConfig(startup_probe=False, scrape_interval_s=0.02))
    return create_app(settings, upstream=upstream)


async def test_a_metrics_page_over_the_bound_is_a_failed_scrape_never_parsed(
        caplog: pytest.LogCaptureFixture) -> None:
    lines = MAX_PROBE_BYTES // len(LINE) + 1
    huge = MockReply(200, TEXT_H, [LINE * (lines // 4)] * 5)
    upstream, seen = fleet("/metrics", huge)
    app = app_for(upstream)
    with caplog.at_level(logging.ERROR, logger="gateway.replicas"):
        async with app.running():
            s = app.services
            assert s is not None
            seen["hang"] = 1
            before = dict(seen)
            await until(lambda: all(seen[k] >= before.get(k, 0) + 3 for k in (
                "bad /metrics", "good /metrics", "bad /health")))
            bad = s.fleet.replicas["bad"]
            assert bad.healthy  # a failed scrape is no failed probe
            snap = bad.snapshot
            assert snap is not None and snap.num_requests_running == 0  # the plain one kept
    logged = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("scrape bad failed (ProbeBodyTooLarge)") for m in logged), logged


@pytest.mark.parametrize("path", ["/metrics", "/v1/models", "/health"])
async def test_a_replica_that_never_answers_stalls_no_other(path: str) -> None:
    upstream, seen = fleet(path, None)
    app = app_for(upstream)
    async with app.running():
        s = app.services
        assert s is not None
        seen["hang"] = 1
        before = dict(seen)
        await until(lambda: all(seen[k] >= before.get(k, 0) + 5 for k in (
            "good /metrics", "good /health", "good /v1/models")), timeout_s=30)
        # And the hanging replica's own steps come round again too.
        await until(lambda: seen[f"bad {path}"] >= before.get(f"bad {path}", 0) + 2,
                    timeout_s=30)
        if path == "/health":  # a probe that never answers is a failed probe
            await until(lambda: not s.fleet.replicas["bad"].healthy, timeout_s=30)
