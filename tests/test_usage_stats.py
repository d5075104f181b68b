"""Stats windows: figures computed from the records' own timestamps and a given `now`."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from gateway.hygiene.finding import Finding
from gateway.usage.record import UsageRecord
from gateway.usage.sketch import QuantileSketch
from gateway.usage.stats import UsageWindows, max_model_len_suggestion
from tests.records import usage_record


def rec(ts: float, **kw: Any) -> UsageRecord:
    base: dict[str, Any] = dict(ts=ts, tenant="t1", cached_tokens=500, completion_tokens=11)
    return usage_record(**{**base, **kw})


NOW = 10_000.0

# (records, window, expected subset of the summary)
CASES: list[tuple[list[UsageRecord], float | None, dict[str, Any]]] = [
    # 1 s buckets: window 60 covers ts > 9940 (bucket 9940 itself ends at 9941 > 9940).
    ([rec(NOW - 10), rec(NOW - 59.5), rec(NOW - 61), rec(NOW - 200)], 60.0,
     {"requests": 2, "prompt_tokens": 2000, "cached_tokens": 1000}),
    ([rec(NOW - 10), rec(NOW - 59.5), rec(NOW - 61), rec(NOW - 200)], 300.0, {"requests": 4}),
    ([rec(NOW - 10), rec(NOW - 59.5), rec(NOW - 61), rec(NOW - 4000)], 3600.0, {"requests": 3}),
    ([rec(NOW - 10), rec(NOW - 4000), rec(NOW - 90_000)], None, {"requests": 3}),
    # records after `now` (clock skew) still count
    ([rec(NOW + 5)], 60.0, {"requests": 1}),
    # nothing in the window
    ([rec(NOW - 500)], 60.0, {"requests": 0, "cached_ratio": None, "available": None}),
    # cached 0 stays 0 and counts in the ratio; None is excluded and counted
    ([rec(NOW, cached_tokens=0), rec(NOW, cached_tokens=None)], 60.0,
     {"cached_tokens": 0, "cached_ratio": 0.0, "records_without_cached_tokens": 1,
      "prompt_tokens": 2000, "delivered": 0.0}),
    # only None: ratio unknown, not 0
    ([rec(NOW, cached_tokens=None)], 60.0,
     {"cached_ratio": None, "delivered": None, "records_without_cached_tokens": 1}),
    # decomposition: available 800/1000, captured 600/800, delivered 500/600
    ([rec(NOW)], 60.0, {"cached_ratio": 0.5, "available": 0.8, "captured": 0.75,
                        "delivered": 500 / 600}),
    # token-weighted, not a mean of per-request ratios
    ([rec(NOW, prompt_tokens=100, cached_tokens=100), rec(NOW, prompt_tokens=900, cached_tokens=0)],
     60.0, {"cached_ratio": 0.1}),
    # failed request without usage: counted by status, no tokens
    ([rec(NOW, status=502, prompt_tokens=None, cached_tokens=None, completion_tokens=None,
          ttft_ms=None, predicted_cached_tokens=600, best_available_tokens=800), rec(NOW)],
     60.0, {"requests": 2, "by_status": {"200": 1, "502": 1}, "prompt_tokens": 1000,
            "records_without_cached_tokens": 0, "captured": 0.75}),
]  # fmt: skip


@pytest.mark.parametrize(("records", "window", "expected"), CASES)
def test_window_figures(
    records: list[UsageRecord], window: float | None, expected: dict[str, Any]
) -> None:
    w = UsageWindows(bucket_s=1.0)
    for r in records:
        w.add(r)
    got = w.summary(NOW, window)
    for key, value in expected.items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value), key
        else:
            assert got[key] == value, key


def test_by_dimension() -> None:
    w = UsageWindows(bucket_s=1.0)
    w.add(rec(NOW, model="m1", replica="a", tenant="x", cached_tokens=1000))
    w.add(rec(NOW, model="m2", replica="a", tenant=None, cached_tokens=0))
    w.add(rec(NOW, model="m2", replica="b", tenant="x", cached_tokens=None))
    s = w.summary(NOW, 60.0)
    assert s["by_model"]["m1"]["cached_ratio"] == 1.0
    assert s["by_model"]["m2"]["cached_ratio"] == 0.0
    assert s["by_model"]["m2"]["records_without_cached_tokens"] == 1
    assert s["by_replica"]["a"]["cached_ratio"] == 0.5
    assert s["by_replica"]["b"]["cached_ratio"] is None
    assert s["by_tenant"]["none"]["requests"] == 1
    assert s["by_tenant"]["x"]["requests"] == 2


@pytest.mark.parametrize(("now", "requests", "covered", "start"), [
    # now - 60 = 1005: bucket [1000, 1010) reaches back further than a minute, left out
    (1065.0, 1, 55.0, 1010.0),
    # on a boundary the window is exactly a minute
    (1070.0, 1, 60.0, 1010.0),
    (1060.0, 2, 60.0, 1000.0),
    (1069.9, 1, 59.9, 1010.0),
])  # fmt: skip
def test_a_window_never_covers_more_than_its_name(
    now: float, requests: int, covered: float, start: float,
) -> None:
    w = UsageWindows(bucket_s=10.0)
    w.add(rec(1005.0))  # bucket [1000, 1010)
    w.add(rec(1012.0))  # bucket [1010, 1020)
    w.add(rec(995.0))  # bucket [990, 1000)
    s = w.summary(now, 60.0)
    assert (s["requests"], s["covered_s"], s["from_ts"], s["to_ts"]) == (
        requests, covered, start, now)


def test_memory_is_bounded_and_old_buckets_are_archived() -> None:
    w = UsageWindows(bucket_s=10.0, horizon_s=3600.0)
    for i in range(20_000):
        w.add(rec(float(i)))  # 20 000 s of records, one per second
    assert w.bucket_count() <= 3600 / 10 + 2
    assert w.summary(19_999.0, None)["requests"] == 20_000
    assert w.summary(19_999.0, 3600.0)["requests"] == pytest.approx(3600, abs=10)
    # a late record older than the horizon still counts since start
    w.add(rec(5.0))
    assert w.summary(19_999.0, None)["requests"] == 20_001
    assert w.bucket_count() <= 3600 / 10 + 2


def test_latency_figures() -> None:
    w = UsageWindows(bucket_s=1.0, ttft_target_ms=1000.0, tpot_target_ms=100.0)
    # TPOT = (600 - 100) / (11 - 1) = 50 ms
    for _ in range(99):
        w.add(rec(NOW))
    w.add(rec(NOW, ttft_ms=5000.0, latency_ms=5000.0, status=200))
    # completion 1 -> no TPOT sample; error status -> no TTFT sample
    w.add(rec(NOW, completion_tokens=1, status=500, ttft_ms=9000.0))
    s = w.summary(NOW, 60.0)
    assert s["tpot"]["samples"] == 100
    assert s["tpot"]["p99_ms"] == pytest.approx(50.0, rel=0.02)
    assert s["tpot"]["ok"] is True
    assert s["ttft"]["samples"] == 100
    assert s["ttft"]["p99_ms"] == pytest.approx(100.0, rel=0.02)
    w.add(rec(NOW, ttft_ms=5000.0))
    w.add(rec(NOW, ttft_ms=5000.0))
    s = w.summary(NOW, 60.0)
    assert s["ttft"]["p99_ms"] == pytest.approx(5000.0, rel=0.02)
    assert s["ttft"]["ok"] is False


@pytest.mark.parametrize(
    ("p99", "expected"),
    [(None, None), (0.0, None), (1.0, 1024), (853.0, 1024), (854.0, 2048), (8024.0, 10240),
     (100_000.0, 120_832)],
)  # fmt: skip
def test_max_model_len_suggestion(p99: float | None, expected: int | None) -> None:
    assert max_model_len_suggestion(p99) == expected


def test_prompt_percentiles_and_suggestion() -> None:
    w = UsageWindows(bucket_s=1.0)
    for i in range(1, 1001):
        w.add(rec(NOW, prompt_tokens=i * 10, cached_tokens=0, completion_tokens=0))
    s = w.summary(NOW, None)
    p = s["prompt_tokens_percentiles"]
    assert p["p50"] == pytest.approx(5000, rel=0.01)
    assert p["p95"] == pytest.approx(9500, rel=0.01)
    assert p["p99"] == pytest.approx(9900, rel=0.01)
    assert s["max_model_len_suggestion"] == 12288  # 9900 * 1.2 = 11880 -> 12288


@pytest.mark.parametrize("q", [0.0, 0.25, 0.5, 0.9, 0.99, 1.0])
def test_sketch_relative_error(q: float) -> None:
    rng = random.Random(7)
    values = sorted(rng.lognormvariate(6, 1.5) for _ in range(5000))
    half = QuantileSketch(0.01)
    other = QuantileSketch(0.01)
    for i, v in enumerate(values):
        (half if i % 2 else other).add(v)
    half.merge(other)
    exact = values[max(0, math.ceil(q * len(values)) - 1)]
    est = half.quantile(q)
    assert est is not None
    assert abs(est - exact) <= 0.0101 * exact


def test_sketch_zeros_and_empty() -> None:
    s = QuantileSketch()
    assert s.quantile(0.5) is None
    s.add(0)
    s.add(0)
    s.add(10)
    assert s.quantile(0.5) == 0.0
    assert s.quantile(1.0) == pytest.approx(10, rel=0.01)


def test_ttft_only_where_a_first_token_was_seen() -> None:
    w = UsageWindows(bucket_s=1.0)
    # non-streamed: the first byte is the last, its "TTFT" is its latency: not a TTFT
    for _ in range(10):
        w.add(rec(NOW, stream=False, ttft_ms=460.0, latency_ms=460.0))
    s = w.summary(NOW, 60.0)
    assert s["ttft"]["samples"] == 0 and s["ttft"]["p99_ms"] is None
    assert s["latency"]["samples"] == 10
    assert s["latency"]["p99_ms"] == pytest.approx(460.0, rel=0.02)
    w.add(rec(NOW, stream=True, ttft_ms=20.0, latency_ms=500.0))
    s = w.summary(NOW, 60.0)
    assert s["ttft"]["samples"] == 1 and s["ttft"]["p99_ms"] == pytest.approx(20.0, rel=0.02)
    assert s["latency"]["samples"] == 11


def test_gateway_rejected_requests_are_not_a_replica() -> None:
    w = UsageWindows(bucket_s=1.0)
    w.add(rec(NOW, replica=None, status=503, prompt_tokens=None, cached_tokens=None))
    w.add(rec(NOW, replica=None, status=400, prompt_tokens=None, cached_tokens=None))
    w.add(rec(NOW, replica="none", status=200))  # a replica may be called anything
    w.add(rec(NOW, replica="a", status=502))
    s = w.summary(NOW, 60.0)
    assert set(s["by_replica"]) == {"a", "none"}
    assert s["by_replica"]["none"]["requests"] == 1
    assert s["gateway_rejected"] == {"requests": 2, "by_status": {"400": 1, "503": 1}}
    assert s["by_status"] == {"200": 1, "400": 1, "502": 1, "503": 1}
    assert all(set(p["by_replica"]) == {"a", "none"} for p in w.series())


def _finding(kind: str, severity: str, tokens: int, offset: int = 0) -> Finding:
    return Finding(kind, severity, "pattern", 0, "system", offset, "<x>", tokens, None)  # type: ignore[arg-type]


def test_hygiene_by_kind_model_and_tenant() -> None:
    w = UsageWindows(bucket_s=1.0)
    # two timestamps in one request break the prefix once: the larger cost counts
    w.add(rec(NOW, model="m1", tenant="x", findings=(
        _finding("timestamp", "warning", 900, 10), _finding("timestamp", "warning", 300, 2000),
        _finding("uuid", "info", 50))))
    w.add(rec(NOW, model="m2", tenant=None, findings=(_finding("timestamp", "warning", 700),)))
    w.add(rec(NOW - 500, findings=(_finding("nonce", "warning", 999),)))  # outside the window
    h = w.summary(NOW, 60.0)["hygiene"]
    assert h["findings"] == 4 and h["tokens_at_risk"] == 1650
    # saving per hour: the tokens at risk over the 60 s the window covers, times 60
    assert h["by_kind"] == [
        {"kind": "timestamp", "severity": "warning", "findings": 3, "requests": 2,
         "tokens_at_risk": 1600, "saving_tokens_per_hour": 96000, "remedy": "",
         "share_of_prompt_tokens": 0.8},
        {"kind": "uuid", "severity": "info", "findings": 1, "requests": 1,
         "tokens_at_risk": 50, "saving_tokens_per_hour": 3000, "remedy": "",
         "share_of_prompt_tokens": 0.025},
    ]
    assert [r["tokens_at_risk"] for r in h["by_model"]["m1"]] == [900, 50]
    assert [r["tokens_at_risk"] for r in h["by_tenant"]["none"]] == [700]
    assert [r["kind"] for r in w.summary(NOW, None)["hygiene"]["by_kind"]] == [
        "timestamp", "nonce", "uuid"]
