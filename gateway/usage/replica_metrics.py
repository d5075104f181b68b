"""The replica families on the gateway's registry, set after each health probe / scrape
(`state`); listed with the others in metrics.py's docstring.

A gauge whose value the last scrape did not report is removed, not set to 0: unknown is
not zero. The prefix-cache figures are the engine's own cumulative counters copied as
gauges, because the gateway does not own them (they reset when the engine restarts).
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Gauge

from gateway.usage.snapshot import EngineSnapshot


class ReplicaMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self._healthy = Gauge(
            "gateway_replica_healthy", "1 when the replica passed its last health check.",
            ("replica",), registry=r,
        )  # fmt: skip
        self._in_flight = Gauge(
            "gateway_replica_in_flight", "This gateway's requests in flight on the replica.",
            ("replica",), registry=r,
        )  # fmt: skip
        self._kv = Gauge(
            "gateway_replica_kv_cache_usage", "Replica KV-cache usage 0..1, last scrape.",
            ("replica",), registry=r,
        )  # fmt: skip
        self._waiting = Gauge(
            "gateway_replica_requests_waiting", "Replica waiting queue, last scrape.",
            ("replica",), registry=r,
        )  # fmt: skip
        self._running = Gauge(
            "gateway_replica_requests_running", "Replica running batch, last scrape.",
            ("replica",), registry=r,
        )  # fmt: skip
        self._hits = Gauge(
            "gateway_replica_prefix_cache_hits_tokens",
            "The replica's cumulative prefix-cache hit tokens counter at the last scrape "
            "(resets with the engine; use delta()).",
            ("replica",), registry=r,
        )  # fmt: skip
        self._queries = Gauge(
            "gateway_replica_prefix_cache_queries_tokens",
            "The replica's cumulative prefix-cache queried tokens counter at the last "
            "scrape (resets with the engine; use delta()).",
            ("replica",), registry=r,
        )  # fmt: skip
        self._capacity = Gauge(
            "gateway_replica_capacity_tokens",
            "Replica KV capacity in tokens (num_gpu_blocks x block_size), last scrape.",
            ("replica",), registry=r,
        )  # fmt: skip

    def state(
        self, name: str, healthy: bool, in_flight: int, snapshot: EngineSnapshot | None
    ) -> None:
        self._healthy.labels(name).set(1.0 if healthy else 0.0)
        self._in_flight.labels(name).set(in_flight)
        snap = snapshot
        capacity = None if snap is None else snap.capacity_tokens
        for gauge, value in (
            (self._kv, None if snap is None else snap.kv_cache_usage),
            (self._waiting, None if snap is None else snap.num_requests_waiting),
            (self._running, None if snap is None else snap.num_requests_running),
            (self._hits, None if snap is None else snap.prefix_cache_hits_total),
            (self._queries, None if snap is None else snap.prefix_cache_queries_total),
            (self._capacity, None if capacity is None else float(capacity)),
        ):
            if value is None:
                # Unknown is not zero: drop the series rather than report a false 0.
                # (prometheus-client < 0.22 raises KeyError for an absent series)
                with contextlib.suppress(KeyError):
                    gauge.remove(name)
            else:
                gauge.labels(name).set(value)
