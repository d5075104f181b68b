"""Outside review of issue 37's tracing: what a client can put in the gateway's spans,
through a real `gateway serve` exporting to the test's OTLP receiver (the fixture of
tests/test_tracing_loopback.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.tracing import propagate
from gateway.tracing.config import TracingSettings
from gateway.tracing.otel import build
from gateway.tracing.tracer import RequestTracer
from tests.otlp_receiver import Receiver
from tests.recording_replica import Recorder
from tests.test_tracing_loopback import span_of, traced

pytest.importorskip("opentelemetry.sdk.trace")

__all__ = ["traced"]  # the module-scoped gateway, shared with the loopback tests

BOUND = 256  # far above any served model's name; far below what a client may send


def test_a_clients_model_name_is_bounded_in_the_span(
        traced: tuple[str, Recorder, Receiver]) -> None:
    """Span attributes are bounded: a client's `model` (20,000 characters here) must not
    reach a span's name nor `gen_ai.request.model` whole; an unknown model (404) is a
    client's free text, as the metrics treat it (`Fleet.known_model` keeps it out of the
    `model` label). Found: gateway/tracing/attributes.py span_name and end_attributes
    (and otel.py `_end`'s update_name) use `rec.model` as the client wrote it."""
    url, _rec, receiver = traced
    body = {"model": "x" * 20_000, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30,
                   headers={"Authorization": "Bearer sk-tenant-a-secret"})
    assert r.status_code == 404, r.text[:300]
    span = span_of(receiver, r)
    assert len(span.name) <= BOUND, len(span.name)
    assert len(str(span.attributes.get("gen_ai.request.model", ""))) <= BOUND


TID, PID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
GOOD = f"00-{TID}-{PID}-01"
# 32 well-formed members of 250 characters each: 8,149 characters, W3C-valid in shape
LONG_STATE = ",".join(f"k{i}=" + "v" * 250 for i in range(32))


@pytest.fixture
def otel_tracer() -> Iterator[RequestTracer]:
    tracer = build(TracingSettings(enabled=True, shutdown_timeout_s=1.0),
                   {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, CollectorRegistry())
    try:
        yield tracer
    finally:
        tracer.close()


def test_tracing_on_bounds_the_clients_tracestate_as_tracing_off_does(
        otel_tracer: RequestTracer) -> None:
    """The client's tracestate that goes upstream is bounded by `MAX_TRACESTATE` (512)
    with tracing off (propagate.client_context); with tracing on it must be no longer.
    Found: gateway/tracing/otel.py `begin` hands the client's headers to the SDK's
    propagator and injects what it kept: any well-formed tracestate, 8,149 characters
    here, goes to every replica whole (and into the engine's spans)."""
    headers = [("traceparent", GOOD), ("tracestate", LONG_STATE)]
    assert propagate.client_context(headers) == (("traceparent", GOOD),)  # off: dropped
    sent = dict(otel_tracer.begin(headers, "chat", "POST").upstream)
    assert sent["traceparent"].startswith(f"00-{TID}-")
    assert len(sent.get("tracestate", "")) <= propagate.MAX_TRACESTATE, len(sent["tracestate"])


def test_a_clients_malformed_tracestate_is_not_written_to_the_log(
        otel_tracer: RequestTracer, caplog: pytest.LogCaptureFixture) -> None:
    """A client's malformed tracestate is dropped; its text must not reach the gateway's
    log (one warning per request, of whatever the client wrote: a client filling the
    operator's log). Found: the SDK's TraceState parser (called from
    gateway/tracing/otel.py `begin`) logs each bad member whole at WARNING through the
    `opentelemetry.trace.span` logger, which the gateway leaves on."""
    caplog.set_level(logging.DEBUG)
    marker = "client-wrote-this-" + "Z" * 2000
    trace = otel_tracer.begin([("traceparent", GOOD), ("tracestate", f"bad {marker}")],
                              "chat", "POST")
    assert "tracestate" not in dict(trace.upstream)
    logged = [r.getMessage() for r in caplog.records if "client-wrote-this" in r.getMessage()]
    assert logged == [], [m[:120] for m in logged]
