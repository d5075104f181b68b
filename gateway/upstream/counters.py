"""Prometheus counters of upstream failures by class, registered on the gateway's own
registry (`GatewayMetrics.registry`). Labels are bounded: `replica` is a configured replica
name, `failure` one of `gateway.upstream.failure.Happened`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from gateway.upstream.failure import Happened


class UpstreamCounters:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._failures = Counter(
            "gateway_upstream_failures", "Tries on a replica that failed, by failure class "
            "(gateway.upstream.failure).", ("replica", "failure"), registry=registry)
        self._pool_busy = Counter(
            "gateway_upstream_pool_busy", "Requests answered 503 + Retry-After because no "
            "pooled connection to the replica came free within server.upstream_pool_wait_s "
            "(the gateway's own congestion).", ("replica",), registry=registry)
        self._retries = Counter(
            "gateway_upstream_retries", "Requests moved to another replica because the one "
            "tried never received them (not delivered).", ("replica",), registry=registry)

    def failure(self, replica: str, what: Happened) -> None:
        self._failures.labels(replica, what).inc()
        if what == "pool_busy":
            self._pool_busy.labels(replica).inc()

    def retried(self, replica: str) -> None:
        """A request moved to `replica` after a try elsewhere was not delivered."""
        self._retries.labels(replica).inc()
