"""OpenTelemetry tracing (`[tracing]`, the `otel` extra): one span per request, the trace
context carried to the replica. tracer.py is the seam the request flow calls;
otel.py the SDK's wiring; attributes.py and propagate.py the pure parts."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry

from gateway.tracing.config import TracingSettings
from gateway.tracing.tracer import Passthrough, RequestTracer


def request_tracer(settings: TracingSettings, env: Mapping[str, str],
                   registry: CollectorRegistry) -> RequestTracer:
    """The tracer `[tracing]` asks for; MissingExtra when on without the `otel` extra."""
    if not settings.enabled:
        return Passthrough()
    from gateway.tracing import otel  # only with the extra

    return otel.build(settings, env, registry)
