"""The classification of /stats fields and /metrics families (gateway.usage.exposure):
fleet-wide fields reach every reader, tenant-scoped ones the operator (no keys, or an
admin key) and, for its own tenant's rows, that tenant's key; a field nobody listed is
private."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from gateway.usage.exposure import FLEET_METRICS, FleetMetrics, audience, stats_view

STATS: dict[str, Any] = {
    "summary": {"requests": 3, "cached_ratio": 0.5, "text": "3 requests, 50% cached"},
    "now": 1.0,
    "windows": {"1m": {
        "requests": 3, "cached_tokens": 9, "cached_ratio": 0.5, "available": 0.4,
        "captured": 1.0, "delivered": 1.0, "latency": {"p99_ms": 3.0},
        "by_model": {"m": {"requests": 3, "cached_ratio": 0.5}},
        "by_replica": {"r1": {"requests": 3, "captured": 1.0}},
        "by_tenant": {"alice": {"requests": 2, "cached_ratio": 0.9},
                      "bob": {"requests": 1, "cached_ratio": 0.0}},
        "hygiene": {"by_kind": [{"kind": "timestamp"}],
                    "by_tenant": {"alice": {"x": 1}, "bob": {"x": 2}}},
        "brand_new_field": 1,
    }},
    "replicas": {"r1": {"healthy": True, "engine_prefix_cache_hit_rate_since_start": 0.7}},
    "series": [{"ts": 0, "cached_ratio": 0.5}],
    "warnings": ["hygiene: timestamp findings put 40% ..."],
    "hygiene": {"window": "1h", "by_kind": [{"kind": "timestamp"}],
                "latest": [{"tenant": "alice", "session": "alice-user-7", "request_id": "ra"},
                           {"tenant": "bob", "session": "bob-user-3", "request_id": "rb"}],
                "by_tenant": {"alice": {}, "bob": {}}},
    "admission": {"enabled": True, "queued": {"high": 0},
                  "admitted_tokens": {"alice": 10, "bob": 20},
                  # how many programs are in a tool call and how much of their context
                  # is held per replica: moves with other tenants' agents (operators only)
                  "agent_programs": {"between_turns": 2, "held_tokens": {"r1": 1896}},
                  # the KV usage the queue reads now moves with every tenant's prompts
                  # sent there since the scrape (operators only; the source is open)
                  "replicas": {"r1": {"source": "engine", "kv_usage": 0.61}}},
}


def leaves(doc: Any, path: str = "") -> set[str]:
    if isinstance(doc, dict):
        return {p for k, v in doc.items() for p in leaves(v, f"{path}.{k}")} or {path}
    if isinstance(doc, list):
        return {p for v in doc for p in leaves(v, f"{path}[]")} or {path}
    return {path}


OPEN = {".summary.requests", ".now", ".windows.1m.requests", ".windows.1m.latency.p99_ms",
        ".windows.1m.by_model.m.requests", ".windows.1m.by_replica.r1.requests",
        ".replicas.r1.healthy", ".admission.enabled", ".admission.queued.high",
        ".admission.replicas.r1.source"}
ALICE = {".windows.1m.by_tenant.alice.requests", ".windows.1m.by_tenant.alice.cached_ratio",
         ".windows.1m.hygiene.by_tenant.alice.x", ".hygiene.window",
         ".hygiene.latest[].tenant", ".hygiene.latest[].session",
         ".hygiene.latest[].request_id", ".hygiene.by_tenant.alice",
         ".admission.admitted_tokens.alice"}


@pytest.mark.parametrize(("who", "tenant", "expected"), [
    ("public", None, OPEN),
    ("tenant", "alice", OPEN | ALICE),
])
def test_a_reader_gets_the_fleet_wide_fields_and_its_own_rows(who: Any, tenant: str | None,
                                                              expected: set[str]) -> None:
    seen = stats_view(STATS, who, tenant)
    assert leaves(seen) == expected
    assert "bob" not in str(seen)
    assert all(r["tenant"] == tenant for r in seen.get("hygiene", {}).get("latest", []))


def test_the_operator_reads_everything() -> None:
    assert stats_view(STATS, "operator") == STATS


@pytest.mark.parametrize(("keys", "tenant", "admin", "who"), [
    (False, None, False, "operator"), (True, "ops", True, "operator"),
    (True, "alice", False, "tenant"), (True, None, False, "public")])
def test_audience(keys: bool, tenant: str | None, admin: bool, who: str) -> None:
    assert audience(keys, tenant, admin) == who


def test_fleet_metrics_keep_the_listed_families_only() -> None:
    r = CollectorRegistry()
    Counter("gateway_requests", "x", ("tenant",), registry=r).labels("alice").inc()
    Counter("gateway_endpoint_requests", "x", ("endpoint",), registry=r).labels("chat").inc()
    Gauge("gateway_replica_prefix_cache_hits_tokens", "x", ("replica",),
          registry=r).labels("r1").set(5)
    Gauge("gateway_something_new", "x", registry=r).set(1)
    text = generate_latest(FleetMetrics(r)).decode()
    assert "gateway_endpoint_requests_total" in text
    assert "alice" not in text and "prefix_cache" not in text and "something_new" not in text


def test_every_fleet_wide_family_exists() -> None:
    """A renamed family would silently become private: the list names real families."""
    from gateway.tracing.otel import SpanCounters
    from gateway.upstream.counters import UpstreamCounters
    from gateway.usage.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    UpstreamCounters(metrics.registry)
    SpanCounters(metrics.registry)  # registered when [tracing] is on
    names = {family.name for family in metrics.registry.collect()}
    assert not FLEET_METRICS - names, sorted(FLEET_METRICS - names)
    # and none of them carries a tenant label
    labelled = {f.name for f in metrics.registry.collect()
                for s in f.samples if "tenant" in s.labels}
    assert not FLEET_METRICS & labelled


def test_the_latency_histograms_are_fleet_wide() -> None:
    """Streams' TTFT and non-streamed answers' latency are read alike (speed, not content):
    a dashboard built on public /metrics shows both or neither."""
    from gateway.usage.metrics import GatewayMetrics
    from tests.records import usage_record

    metrics = GatewayMetrics()
    metrics.observe(usage_record(stream=True))
    metrics.observe(usage_record(stream=False))
    text = generate_latest(FleetMetrics(metrics.registry)).decode()
    for family in ("gateway_ttft_seconds", "gateway_non_streamed_latency_seconds",
                   "gateway_request_latency_seconds"):
        assert f"{family}_count{{" in text, family
