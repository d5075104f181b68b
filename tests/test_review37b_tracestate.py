"""Second outside review of issue 37: the client's tracestate as the W3C trace-context
grammar reads it. What W3C (and the OpenTelemetry SDK's TraceState parser) accepts must be
continued to the replica, with tracing off (propagate.client_context) and on (the SDK's
propagator fed by gateway/tracing/otel.py `_carrier`); what W3C refuses must reach no
engine either way."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from gateway.tracing import propagate
from gateway.tracing.config import TracingSettings
from gateway.tracing.otel import build
from gateway.tracing.tracer import RequestTracer

TID, PID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
GOOD = f"00-{TID}-{PID}-01"
VENDORS_32 = ",".join(f"t{i}@vendor=x{i}" for i in range(32))

# (tracestate, whether W3C trace-context level 1 accepts it). The grammar:
# simple-key = lcalpha 0*255(lcalpha / DIGIT / "_" / "-" / "*" / "/")
# multi-tenant-key = tenant-id "@" system-id; tenant-id = (lcalpha / DIGIT) 0*240(...);
#   system-id = lcalpha 0*13(...)
# value = 0*255(chr) nblk-chr (1 to 256 characters, the last not a space)
# keys unique; at most 32 list-members (empty members allowed, not counted)
TABLE = [
    ("k=" + "v" * 256, True),                         # a value of 256: the most W3C allows
    ("a=1,b=2", True),
    (VENDORS_32, True),                                # 32 vendor members, 447 chars
    (VENDORS_32 + ",", True),                          # an empty member is no member
    ("1abc=x", False),                                 # a simple key begins with lcalpha
    ("a@b@c=x", False),                                # one "@" at most
    ("t@1sys=x", False),                               # a system-id begins with lcalpha
    ("t@" + "s" * 20 + "=x", False),                   # a system-id is 14 at most
    ("k=", False),                                     # a value is 1 character at least
    ("a=1,a=2", False),                                # keys are unique
    ("Upper=x", False),                                # lowercase keys only
]


def sdk_accepts(state: str) -> bool:
    """The OpenTelemetry SDK's parser: the reference the gateway's check should agree with
    (with tracing on the SDK re-parses whatever the gateway lets through)."""
    span = pytest.importorskip("opentelemetry.trace.span")
    return len(span.TraceState.from_header([state])) > 0


@pytest.mark.parametrize(("state", "w3c"), TABLE)
def test_the_table_is_the_sdks_reading(state: str, w3c: bool) -> None:
    """The table's verdicts are the SDK's: the reference is not this file's opinion."""
    assert sdk_accepts(state) is w3c


@pytest.mark.parametrize(("state", "w3c"), TABLE)
def test_tracing_off_continues_exactly_the_w3c_tracestates(state: str, w3c: bool) -> None:
    """Tracing off, the tracestate goes upstream when W3C accepts it and only then.
    Found: gateway/tracing/propagate.py:21 `_MEMBER` is not W3C's grammar: a value is cut
    at 255 characters (W3C: 256), keys may begin with a digit without a tenant, hold
    several "@", a system-id of any length and first character; an empty value passes;
    duplicate keys pass; and :37 counts empty members toward the 32."""
    sent = dict(propagate.client_context([("traceparent", GOOD), ("tracestate", state)]))
    assert ("tracestate" in sent) is w3c, state[:80]


@pytest.fixture
def otel_tracer() -> Iterator[RequestTracer]:
    pytest.importorskip("opentelemetry.sdk.trace")
    tracer = build(TracingSettings(enabled=True, shutdown_timeout_s=1.0),
                   {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, CollectorRegistry())
    try:
        yield tracer
    finally:
        tracer.close()


@pytest.mark.parametrize(("state", "w3c"), [row for row in TABLE if row[1]])
def test_tracing_on_continues_every_w3c_tracestate(otel_tracer: RequestTracer, state: str,
                                                   w3c: bool) -> None:
    """Tracing on, a W3C-valid tracestate of at most 512 characters is continued (the SDK
    would keep it). Found: gateway/tracing/otel.py `_carrier` (via propagate.py:21 and :37)
    withholds a 256-character value and 32 members followed by an empty one, so the
    trace is continued without the client's vendors' state."""
    sent = dict(otel_tracer.begin([("traceparent", GOOD), ("tracestate", state)],
                                  "chat", "POST").upstream)
    assert sent["traceparent"].startswith(f"00-{TID}-")
    assert sent.get("tracestate", "").replace(" ", "") == state.rstrip(","), state[:80]


def test_a_second_tracestate_header_is_combined() -> None:
    """W3C: several tracestate headers in a request SHOULD be combined as one list (RFC
    9110 field lines). Found: gateway/tracing/propagate.py:46 (`_first`) forwards the
    first header's members only; the second vendor's state is lost."""
    sent = dict(propagate.client_context([("traceparent", GOOD), ("tracestate", "a=1"),
                                          ("tracestate", "b=2")]))
    assert sent.get("tracestate", "").replace(" ", "") in ("a=1,b=2", "b=2,a=1")
