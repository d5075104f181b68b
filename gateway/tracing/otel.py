"""Tracing on: OpenTelemetry's SDK (the `otel` extra), one server span per request.

The provider is the gateway's own (never the process-global one: a library in the same
process cannot reconfigure it), configured by the standard OTEL_* variables: the OTLP
exporter reads OTEL_EXPORTER_OTLP[_TRACES]_{ENDPOINT,HEADERS,TIMEOUT,...}, the sampler
OTEL_TRACES_SAMPLER[_ARG] (default parentbased_always_on: a client's sampled flag is
followed), the resource OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES (service.name
defaults to "cache-gateway"), the batch processor OTEL_BSP_SCHEDULE_DELAY and
OTEL_BSP_EXPORT_TIMEOUT; the protocol, OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL, picks the
exporter ("http/protobuf", the default, or "grpc").

Never on the request path: a span ends into a bounded queue (`[tracing] max_queue`,
counted here: spans waiting or being exported) and the SDK's batch processor exports from
its own thread. A span that finds the queue full is dropped, and so are the spans of an
export that failed (collector down, after the exporter's own retries within its
timeout): each counted in gateway_trace_spans_dropped_total{reason}.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gateway.extras import MissingExtra, require
from gateway.tracing import attributes, propagate, protofix
from gateway.tracing.config import TracingSettings
from gateway.tracing.tracer import Trace
from gateway.usage.record import UsageRecord

log = logging.getLogger("gateway.tracing")
EXTRA = "otel"
FEATURE = "[tracing] enabled"
SERVICE_NAME = "cache-gateway"
# the API's TraceState parser logs each member it refuses, whole, at WARNING: a client's
# header text, once per request
SDK_TRACESTATE_LOGGER = "opentelemetry.trace.span"


def protocol(env: Mapping[str, str]) -> str:
    """The OTLP protocol the OTEL_* variables ask for (pure)."""
    value = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
             or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if value not in ("http/protobuf", "grpc"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL {value!r}: the gateway exports "
                         "'http/protobuf' or 'grpc'")
    return value


def _exporter(env: Mapping[str, str]) -> Any:
    if protocol(env) == "grpc":
        grpc = require("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", extra=EXTRA,
                       feature=FEATURE + " with OTEL_EXPORTER_OTLP_PROTOCOL=grpc "
                       "(and opentelemetry-exporter-otlp-proto-grpc)")
        return grpc.OTLPSpanExporter()
    http = require("opentelemetry.exporter.otlp.proto.http.trace_exporter", extra=EXTRA,
                   feature=FEATURE)
    return http.OTLPSpanExporter()


class SpanCounters:
    """The spans' fate, in the gateway's /metrics registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.dropped = Counter(
            "gateway_trace_spans_dropped", "Finished spans not exported: the queue was full "
            "(queue_full) or their export failed (export_failed: collector down or refusing).",
            ["reason"], registry=registry)
        self.exported = Counter("gateway_trace_spans_exported",
                                "Spans the collector accepted.", registry=registry)
        for reason in ("queue_full", "export_failed"):
            self.dropped.labels(reason)


def build(settings: TracingSettings, env: Mapping[str, str],
          registry: CollectorRegistry) -> OtelTracer:
    """The SDK wired as the module docstring says; MissingExtra without the `otel` extra."""
    sdk_trace = require("opentelemetry.sdk.trace", extra=EXTRA, feature=FEATURE)
    export = require("opentelemetry.sdk.trace.export", extra=EXTRA, feature=FEATURE)
    resources = require("opentelemetry.sdk.resources", extra=EXTRA, feature=FEATURE)
    if protofix.overwritten():  # xds-protos (the epp extra) installed over it
        raise MissingExtra(protofix.broken_message())
    exporter = _exporter(env)
    counters = SpanCounters(registry)
    given = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    provider = sdk_trace.TracerProvider(resource=resources.Resource.create(given))
    bounded = _bounded_processor(sdk_trace, export, exporter, settings, counters)
    provider.add_span_processor(bounded)
    return OtelTracer(provider, settings)


def _bounded_processor(sdk_trace: Any, export: Any, exporter: Any,
                       settings: TracingSettings, counters: SpanCounters) -> Any:
    """A span processor that counts what it holds, in front of the SDK's batch processor
    (whose own queue drops silently when full), and an exporter that counts the outcome."""
    lock = threading.Lock()
    pending = [0]  # spans accepted and not yet exported or dropped: <= settings.max_queue

    class Counting(export.SpanExporter):  # type: ignore[misc]
        def export(self, spans: Sequence[Any]) -> Any:
            try:
                result = exporter.export(spans)
            except Exception:  # an exporter bug must not end the export thread
                log.exception("span export failed")
                result = export.SpanExportResult.FAILURE
            with lock:
                pending[0] -= len(spans)
            if result == export.SpanExportResult.SUCCESS:
                counters.exported.inc(len(spans))
            else:
                counters.dropped.labels("export_failed").inc(len(spans))
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(exporter.force_flush(timeout_millis))

    batch = export.BatchSpanProcessor(Counting(), max_queue_size=settings.max_queue,
                                      max_export_batch_size=min(settings.max_batch,
                                                                settings.max_queue))

    class Bounded(sdk_trace.SpanProcessor):  # type: ignore[misc]
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            return None

        def on_end(self, span: Any) -> None:
            if not span.context.trace_flags.sampled:
                return
            with lock:
                full = pending[0] >= settings.max_queue
                if not full:
                    pending[0] += 1
            if full:
                counters.dropped.labels("queue_full").inc()
                return
            batch.on_end(span)

        def shutdown(self) -> None:
            batch.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(batch.force_flush(timeout_millis))

    return Bounded()


def _carrier(headers: Sequence[tuple[str, str]]) -> dict[str, str]:
    """What the propagator may read of the client's trace headers (pure): the first
    traceparent as sent (the SDK validates it, and continues a later W3C version), its
    tracestate only when well formed and within MAX_TRACESTATE, as with tracing off
    (propagate.client_context): the SDK keeps and re-sends any well-formed one, of any
    length, to every replica."""
    lowered = [(k.lower(), v) for k, v in headers]
    parent = next((v for k, v in lowered if k == "traceparent"), None)
    state = propagate.tracestate(lowered)  # every tracestate header, combined
    carrier = {} if parent is None else {"traceparent": parent}
    if parent is not None and propagate.valid_tracestate(state):
        assert state is not None
        carrier["tracestate"] = state
    return carrier


class _Drop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


class OtelTracer:
    """begin/end as gateway.tracing.tracer.RequestTracer says."""

    def __init__(self, provider: Any, settings: TracingSettings) -> None:
        trace_api = require("opentelemetry.trace", extra=EXTRA, feature=FEATURE)
        tracecontext = require("opentelemetry.trace.propagation.tracecontext", extra=EXTRA,
                               feature=FEATURE)
        self._api = trace_api
        self._provider = provider
        self._settings = settings
        self._tracer = provider.get_tracer("cache-gateway")
        # W3C trace context only: what vLLM reads (never the process-wide propagators)
        self._propagator = tracecontext.TraceContextTextMapPropagator()
        # The gateway feeds that logger only clients' headers (it builds no TraceState
        # of its own), so while this tracer exists it writes nothing: a refused header is
        # the client's text, and one warning per request is the client filling the
        # operator's log. Only this logger, only until close(): other loggers of the SDK
        # (export failures) still write.
        self._quiet = _Drop()
        logging.getLogger(SDK_TRACESTATE_LOGGER).addFilter(self._quiet)

    def begin(self, headers: Sequence[tuple[str, str]], endpoint: str, method: str,
              model: str | None = None) -> Trace:
        carrier = _carrier(headers)
        # an invalid traceparent is ignored by the propagator: a new trace is started
        parent = self._propagator.extract(carrier)
        span = self._tracer.start_span(
            attributes.span_name(endpoint, model), context=parent,
            kind=self._api.SpanKind.SERVER,
            attributes=attributes.start_attributes(endpoint, method, model))
        out: dict[str, str] = {}
        self._propagator.inject(out, context=self._api.set_span_in_context(span))
        return Trace(span, tuple(out.items()))

    def end(self, trace: Trace, rec: UsageRecord, admission_class: str | None,
            queued_ms: float | None) -> None:
        span = trace.span
        if span is None:
            return
        try:
            self._end(span, rec, admission_class, queued_ms)
        except Exception:  # a span is never worth a request: logged, the request goes on
            log.exception("ending the request's span failed")

    def _end(self, span: Any, rec: UsageRecord, admission_class: str | None,
             queued_ms: float | None) -> None:
        if rec.endpoint in attributes.OPERATION and rec.model:
            span.update_name(attributes.span_name(rec.endpoint, rec.model))
        span.set_attributes(attributes.end_attributes(rec, admission_class, queued_ms))
        if rec.status >= 500 or rec.status == 0:
            span.set_status(self._api.Status(self._api.StatusCode.ERROR, rec.error or None))
        span.end()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Export what is queued now (bench/bench_tracing.py counts the export's CPU)."""
        return bool(self._provider.force_flush(int(timeout_s * 1000)))

    def close(self) -> None:
        """Export what is queued, within [tracing] shutdown_timeout_s (the rest dropped)."""
        logging.getLogger(SDK_TRACESTATE_LOGGER).removeFilter(self._quiet)
        done = threading.Thread(target=self._provider.shutdown, name="trace-shutdown",
                                daemon=True)
        done.start()
        done.join(self._settings.shutdown_timeout_s)
