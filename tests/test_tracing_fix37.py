"""Tracing on, what of a client's trace headers the SDK sees and what it may log
(the fixes of the review's tests/test_tracing_review37.py)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from gateway.tracing.config import TracingSettings
from gateway.tracing.otel import SDK_TRACESTATE_LOGGER, _carrier, build
from tests.test_tracing_review37 import GOOD, LONG_STATE, otel_tracer

pytest.importorskip("opentelemetry.sdk.trace")

__all__ = ["otel_tracer"]  # the review's fixture: a tracer exporting nowhere


@pytest.mark.parametrize(("headers", "expected"), [
    ([], {}),
    ([("Traceparent", GOOD), ("TraceState", "a=1")], {"traceparent": GOOD, "tracestate": "a=1"}),
    ([("traceparent", GOOD), ("tracestate", LONG_STATE)], {"traceparent": GOOD}),
    ([("traceparent", GOOD), ("tracestate", "bad one")], {"traceparent": GOOD}),
    ([("tracestate", "a=1")], {}),  # no parent: nothing to attach it to
    # a later W3C version: the SDK decides (it continues one), as before
    ([("traceparent", "01" + GOOD[2:]), ("tracestate", "a=1")],
     {"traceparent": "01" + GOOD[2:], "tracestate": "a=1"}),
    # the first traceparent; every tracestate header, combined (W3C: one list)
    ([("traceparent", GOOD), ("traceparent", "x"), ("tracestate", "a=1"),
      ("tracestate", "b=2")], {"traceparent": GOOD, "tracestate": "a=1,b=2"}),
    ([("traceparent", GOOD), ("tracestate", "a=1"), ("tracestate", "a=2")],
     {"traceparent": GOOD}),  # combined, a key twice: not W3C's

])
def test_the_sdk_reads_the_clients_tracestate_only_when_valid_and_bounded(
        headers: list[tuple[str, str]], expected: dict[str, str]) -> None:
    assert _carrier(headers) == expected


def test_the_sdks_refusal_of_a_tracestate_is_not_logged_while_a_tracer_exists(
        caplog: pytest.LogCaptureFixture) -> None:
    """The SDK's parser logs each member it refuses, whole: a client's text. The gateway's
    check is W3C's grammar, as the SDK's, so it hands the SDK no tracestate the SDK
    refuses; the logger is silenced all the same while a tracer exists (an SDK whose
    reading differs from the gateway's), here fed the refused member directly."""
    caplog.set_level(logging.DEBUG)
    state = "0client-wrote-this=1"  # W3C: a simple key starts with a letter
    assert "tracestate" not in _carrier([("traceparent", GOOD), ("tracestate", state)])
    span = pytest.importorskip("opentelemetry.trace.span")
    tracer = build(TracingSettings(enabled=True, shutdown_timeout_s=1.0),
                   {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, CollectorRegistry())
    try:
        assert len(span.TraceState.from_header([state])) == 0  # refused, and logged
    finally:
        tracer.close()
    assert [r for r in caplog.records if "client-wrote-this" in r.getMessage()] == []
    # closed: the SDK's logger is as the gateway found it
    logging.getLogger(SDK_TRACESTATE_LOGGER).warning("after %s", "close")
    assert any(r.getMessage() == "after close" for r in caplog.records)
