"""GatewayMetrics: the rendered text parses back and every documented metric is there."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.usage import metrics as metrics_module
from gateway.usage.metrics import DOCUMENTED_METRICS, PROCESS_METRICS, GatewayMetrics
from gateway.usage.record import UsageRecord
from gateway.usage.snapshot import EngineSnapshot
from tests.records import usage_record as rec

SNAP = EngineSnapshot(
    ts=1.0, kv_cache_usage=0.5, num_requests_running=2.0, num_requests_waiting=1.0,
    prefix_cache_queries_total=100.0, prefix_cache_hits_total=40.0, prompt_tokens_total=100.0,
    generation_tokens_total=5.0, num_gpu_blocks=10, block_size=16,
)  # fmt: skip


def samples(m: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def exposed_names(m: GatewayMetrics) -> set[str]:
    names = set()
    for fam in text_string_to_metric_families(m.render().decode()):
        names.add(fam.name + "_total" if fam.type == "counter" else fam.name)
    return names


def test_every_documented_metric_is_rendered_and_documented() -> None:
    m = GatewayMetrics()
    m.observe(rec())
    m.observe(rec(cached_tokens=None, replica="b"))
    m.route_decision("prefix")
    m.hygiene_finding("timestamp", "warning")
    m.sink_error("file")
    m.records_dropped("file", 3)
    m.replica_state("a", True, 2, SNAP)
    names = exposed_names(m)
    for name in DOCUMENTED_METRICS:
        assert name in names, name
        assert name in (metrics_module.__doc__ or ""), f"{name} missing from the docstring"
    assert not [n for n in names if n.endswith("_created")]
    assert names == set(DOCUMENTED_METRICS) | set(PROCESS_METRICS)
    assert all(n.startswith("gateway_") for n in names - set(PROCESS_METRICS))
    for name in PROCESS_METRICS:
        assert name in (metrics_module.__doc__ or ""), f"{name} missing from the docstring"


def test_fresh_registry_renders_documented_families() -> None:
    # families exist before any sample (dashboards do not break on an idle gateway)
    names = exposed_names(GatewayMetrics())
    assert set(DOCUMENTED_METRICS) <= names


def test_two_instances_do_not_share_state() -> None:
    a, b = GatewayMetrics(), GatewayMetrics()
    a.observe(rec())
    assert ("gateway_requests_total", ()) not in samples(b)
    assert not any(k[0] == "gateway_requests_total" for k in samples(b))


def test_cached_zero_and_none_are_different() -> None:
    m = GatewayMetrics()
    m.observe(rec(replica="zero", cached_tokens=0))
    m.observe(rec(replica="none", cached_tokens=None))
    s = samples(m)
    labels = (("model", "m"), ("replica", "zero"), ("route", "prefix"), ("tenant", "none"))
    assert s[("gateway_cached_tokens_total", labels)] == 0.0
    assert s[("gateway_prompt_tokens_total", labels)] == 1000.0
    # a reported 0 is a ratio sample of 0; a missing value is no ratio sample
    assert s[("gateway_cached_ratio_count", (("model", "m"), ("replica", "zero")))] == 1.0
    assert s[("gateway_cached_ratio_bucket", (("le", "0.0"), ("model", "m"),
                                              ("replica", "zero")))] == 1.0  # fmt: skip
    assert s[("gateway_cached_ratio_count", (("model", "m"), ("replica", "none")))] == 0.0
    assert s[("gateway_records_without_cached_tokens_total", (("replica", "none"),))] == 1.0
    assert ("gateway_records_without_cached_tokens_total", (("replica", "zero"),)) not in s


@pytest.mark.parametrize(
    ("record", "key", "value"),
    [
        (rec(status=200), ("gateway_requests_total", (("model", "m"), ("replica", "a"),
         ("route", "prefix"), ("status", "200"), ("tenant", "none"))), 1.0),
        (rec(status=502, replica=None, route=None, prompt_tokens=None, cached_tokens=None),
         ("gateway_requests_total", (("model", "m"), ("replica", "none"), ("route", "none"),
          ("status", "502"), ("tenant", "none"))), 1.0),
        (rec(tenant="acme", cached_tokens=900), ("gateway_cached_tokens_total", (("model", "m"),
         ("replica", "a"), ("route", "prefix"), ("tenant", "acme"))), 900.0),
        (rec(), ("gateway_predicted_cached_tokens_total", (("model", "m"), ("replica", "a"),
         ("route", "prefix"), ("tenant", "none"))), 600.0),
        (rec(), ("gateway_best_available_tokens_total", (("model", "m"), ("replica", "a"),
         ("route", "prefix"), ("tenant", "none"))), 800.0),
        (rec(), ("gateway_completion_tokens_total", (("model", "m"), ("replica", "a"),
         ("route", "prefix"), ("tenant", "none"))), 10.0),
        (rec(ttft_ms=100.0), ("gateway_ttft_seconds_sum", (("model", "m"), ("replica", "a"))),
         0.1),
        # a non-streamed answer's first byte is its last: its whole latency goes in its
        # own histogram, never in the TTFT (a long generation is not a slow first token)
        (rec(stream=False, ttft_ms=5000.0, latency_ms=5000.0), ("gateway_ttft_seconds_count",
         (("model", "m"), ("replica", "a"))), 0.0),
        (rec(stream=False, ttft_ms=5000.0, latency_ms=5000.0),
         ("gateway_non_streamed_latency_seconds_sum", (("model", "m"), ("replica", "a"))), 5.0),
        (rec(stream=True, ttft_ms=100.0, latency_ms=5000.0),
         ("gateway_non_streamed_latency_seconds_count", (("model", "m"), ("replica", "a"))),
         0.0),
        (rec(stream=False, ttft_ms=5000.0, latency_ms=5000.0),
         ("gateway_request_latency_seconds_sum", (("model", "m"), ("replica", "a"))), 5.0),
        (rec(latency_ms=600.0), ("gateway_request_latency_seconds_sum",
         (("model", "m"), ("replica", "a"))), 0.6),
        (rec(prompt_tokens=100_000), ("gateway_request_prompt_tokens_bucket",
         (("le", "131072.0"), ("model", "m"), ("replica", "a"))), 1.0),
        (rec(prompt_tokens=100_000), ("gateway_request_prompt_tokens_bucket",
         (("le", "65536.0"), ("model", "m"), ("replica", "a"))), 0.0),
    ],
)  # fmt: skip
def test_observe_values(record: UsageRecord, key: Any, value: float) -> None:
    m = GatewayMetrics()
    m.observe(record)
    m.observe(record)  # the cached children are reused
    assert samples(m)[key] == pytest.approx(2 * value)


def test_replica_state_unknown_is_absent_not_zero() -> None:
    m = GatewayMetrics()
    m.replica_state("a", True, 3, SNAP)
    s = samples(m)
    lab = (("replica", "a"),)
    assert s[("gateway_replica_kv_cache_usage", lab)] == 0.5
    assert s[("gateway_replica_capacity_tokens", lab)] == 160.0
    assert s[("gateway_replica_prefix_cache_hits_tokens", lab)] == 40.0
    assert s[("gateway_replica_prefix_cache_queries_tokens", lab)] == 100.0
    assert s[("gateway_replica_in_flight", lab)] == 3.0
    m.replica_state("a", False, 0, None)
    s = samples(m)
    assert s[("gateway_replica_healthy", lab)] == 0.0
    assert ("gateway_replica_kv_cache_usage", lab) not in s
    assert ("gateway_replica_capacity_tokens", lab) not in s
    m.remove_replica("a")
    assert ("gateway_replica_healthy", lab) not in samples(m)


def test_event_counters() -> None:
    m = GatewayMetrics()
    m.route_decision("prefix")
    m.route_decision("prefix")
    m.route_decision("load")
    m.route_move("evicted")
    m.route_move("a client-chosen label")  # not a reason: no series for it
    m.hygiene_finding("uuid", "warning")
    m.sink_error("redis")
    s = samples(m)
    moves = {k[1][0][1]: v for k, v in s.items() if k[0] == "gateway_route_moves_total"}
    assert moves == {"unavailable": 0.0, "evicted": 1.0, "load": 0.0}
    assert s[("gateway_routing_decisions_total", (("reason", "prefix"),))] == 2.0
    assert s[("gateway_routing_decisions_total", (("reason", "load"),))] == 1.0
    assert s[("gateway_hygiene_findings_total", (("kind", "uuid"), ("severity", "warning")))] == 1
    assert s[("gateway_usage_sink_errors_total", (("sink", "redis"),))] == 1.0
