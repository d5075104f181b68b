"""The gateway process's own series in /metrics (prometheus_client's process, GC and
platform collectors on the gateway's registry), no `*_created` samples (dropped by that
registry alone, not process-wide), and who reads them (gateway.usage.exposure)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.proxy.app import create_app
from gateway.settings import AuthSettings
from gateway.usage.metrics import PROCESS_METRICS, GatewayMetrics
from tests.proxy_fakes import Fake, chat, settings, started


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_process_series_and_no_created_samples() -> None:
    m = GatewayMetrics()
    m.route_decision("prefix")
    text = m.render().decode()
    for name in PROCESS_METRICS:
        assert f"\n{name}" in text, name
    assert "_created" not in text
    assert "gateway_routing_decisions_total{" in text
    # the process's other registries keep theirs: nothing was switched off globally
    other = CollectorRegistry()
    Counter("x_events", "x", registry=other).inc()
    assert "x_events_created" in generate_latest(other).decode()


def test_two_gateways_in_one_process_each_have_the_process_series() -> None:
    a, b = GatewayMetrics(), GatewayMetrics()
    assert b"process_cpu_seconds_total" in a.render()
    assert b"process_cpu_seconds_total" in b.render()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_lints_the_exposition() -> None:
    m = GatewayMetrics()
    m.route_decision("prefix")
    proc = subprocess.run(["promtool", "check", "metrics"], input=m.render(),
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(("keys", "public", "authorization", "process", "info"), [
    ({}, False, None, True, True),  # no keys: the operator
    ({"k1": "team-a", "k2": "ops"}, False, "Bearer k2", True, True),  # an admin key
    ({"k1": "team-a", "k2": "ops"}, False, "Bearer k1", True, False),  # a tenant's key
    ({"k1": "team-a", "k2": "ops"}, True, None, True, False),  # public_metrics, no key
])
async def test_who_reads_the_process_series(keys: dict[str, str], public: bool,
                                            authorization: str | None, process: bool,
                                            info: bool) -> None:
    s = dataclasses.replace(settings(), auth=AuthSettings(
        keys=keys, admin_tenants=("ops",) if keys else (), public_metrics=public))
    headers = {"authorization": authorization} if authorization else {}
    async for client in started(create_app(s, upstream=Fake().upstream), []):
        await client.post("/v1/chat/completions", json=chat(), headers=headers)
        r = await client.get("/metrics", headers=headers)
    assert r.status_code == 200
    got = families(r.text)
    assert ("process_resident_memory_bytes" in got) is process
    assert ("python_gc_collections" in got) is process
    assert ("python_info" in got) is info
    assert "_created" not in r.text
