"""`[tracing]`: OpenTelemetry spans, one per request (the `otel` extra; gateway.tracing)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class TracingSettings:
    """OpenTelemetry spans, one per request, and the trace context sent to the replicas
    (gateway.tracing; docs/operations/alerts-dashboard.md)."""

    # One span per request, exported over OTLP to the collector the standard OTEL_*
    # variables name (OTEL_EXPORTER_OTLP_ENDPOINT / _TRACES_ENDPOINT, _PROTOCOL
    # "http/protobuf" or "grpc", OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER[_ARG],
    # OTEL_BSP_SCHEDULE_DELAY...). Needs the `otel` extra. Off: no span; a client's
    # traceparent still reaches the replica when it is well formed (W3C), never otherwise.
    enabled: bool = False
    # Finished spans waiting for (or in) an export, at most; more are dropped and counted
    # (gateway_trace_spans_dropped_total{reason="queue_full"}): a collector that is slow or
    # down never holds the request path nor grows the gateway's memory.
    max_queue: int = 2048
    # Spans per export request (the batch processor's max_export_batch_size; at most
    # max_queue).
    max_batch: int = 512
    # At shutdown, how long the spans still queued may take to go; then they are dropped.
    shutdown_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_queue < 1 or self.max_batch < 1:
            raise ValueError("tracing.max_queue and tracing.max_batch must be >= 1")
        if self.shutdown_timeout_s < 0:
            raise ValueError("tracing.shutdown_timeout_s must be >= 0")
