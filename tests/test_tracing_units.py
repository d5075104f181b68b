"""Tracing's pure parts by table (the W3C checks, what goes upstream, the span's
attributes, the OTLP protocol), the `otel` extra missing, and the endpoint picker's header
mutation: the gateway span's context set on the request Envoy forwards, a client's
unchecked one removed (gateway.tracing)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence

import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.coerce import SettingsError
from gateway.epp import messages
from gateway.epp.picker import Picker
from gateway.extras import MissingExtra
from gateway.hygiene.finding import Finding
from gateway.proxy.app import create_app
from gateway.settings import EppSettings, parse_settings
from gateway.tracing import propagate, request_tracer
from gateway.tracing.attributes import end_attributes, span_name, start_attributes
from gateway.tracing.config import TracingSettings
from gateway.tracing.otel import protocol
from gateway.tracing.tracer import Passthrough
from gateway.usage.record import UsageRecord
from tests.otlp_receiver import Receiver
from tests.proxy_fakes import MODEL, Fake, settings

TID, PID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
GOOD = f"00-{TID}-{PID}-01"


@pytest.mark.parametrize(("value", "ok"), [
    (GOOD, True),
    (f"00-{TID}-{PID}-00", True),  # not sampled: still a context to continue
    (None, False), ("", False), ("00-bad", False),
    (f"01-{TID}-{PID}-01", False),  # a version this gateway does not read
    (f"00-{TID.upper()}-{PID}-01", False),  # uppercase hex
    (f"00-{'0' * 32}-{PID}-01", False), (f"00-{TID}-{'0' * 16}-01", False),
    (f"00-{TID}-{PID}-01 ", False), (f"00-{TID}-{PID}-01-extra", False),
    (f" 00-{TID}-{PID}-01", False), (f"00-{TID}-{PID}-0g", False),
])
def test_valid_traceparent(value: str | None, ok: bool) -> None:
    assert propagate.valid_traceparent(value) is ok


@pytest.mark.parametrize(("value", "ok"), [
    ("congo=t61rcWkgMzE", True), ("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE", True),
    ("a=1, b=2", True), ("tenant@vendor=x", True),
    (None, False), ("", False), ("noequals", False), ("Upper=1", False),
    ("a=" + "x" * 600, False), (",".join(f"k{i}=v" for i in range(33)), False),
    ("a=1\tb", False),
])
def test_valid_tracestate(value: str | None, ok: bool) -> None:
    assert propagate.valid_tracestate(value) is ok


# W3C Trace Context's tracestate grammar at its edges (propagate.py states it), within
# MAX_TRACESTATE: each verdict is also the OpenTelemetry SDK's parser's (below), so that the
# gateway forwards exactly what the SDK, and an engine parsing as W3C says, accepts.
MEMBERS_32 = ",".join(f"k{i}=v" for i in range(32))
W3C_EDGES = [
    ("k=" + "v" * 257, False),                                # a value is 256 at most
    ("k=" + " " * 5 + "x", True), ("k=a b", True),            # inner spaces are chr
    ("k= ", False), ("k=x=y", False), ("k=\u00e9", False),    # last not a space; no "="
    ("a" + "b" * 255 + "=x", True), ("a" + "b" * 256 + "=x", False),  # simple key: 256
    ("t" * 241 + "@s=x", True), ("t" * 242 + "@s=x", False),  # tenant-id: 241
    ("t@s" + "y" * 13 + "=x", True), ("t@s" + "y" * 14 + "=x", False),  # system-id: 14
    ("0t@vendor=x", True), ("0t=x", False), ("t@0v=x", False),
    ("a=1,,b=2", True), (MEMBERS_32 + ",,,", True), (MEMBERS_32 + ",k32=v", False),
    (",, ,", False),                                          # no member at all
    ("a=1, \tb=2", True), ("a=1,b=2,a=3", False),
]


@pytest.mark.parametrize(("value", "ok"), W3C_EDGES)
def test_tracestate_is_checked_by_w3cs_grammar(value: str, ok: bool) -> None:
    assert propagate.valid_tracestate(value) is ok


@pytest.mark.parametrize(("value", "ok"), W3C_EDGES)
def test_the_w3c_edges_are_the_sdks_reading(value: str, ok: bool) -> None:
    span = pytest.importorskip("opentelemetry.trace.span")
    assert (len(span.TraceState.from_header([value])) > 0) is ok


@pytest.mark.parametrize(("headers", "expected"), [
    ([("tracestate", "a=1")], "a=1"), ([], None), ([("traceparent", GOOD)], None),
    ([("tracestate", "a=1"), ("TraceState", "b=2")], "a=1,b=2"),
    ([("tracestate", "a=1"), ("x", "y"), ("tracestate", "")], "a=1,"),
])
def test_several_tracestate_headers_are_one_list(headers: list[tuple[str, str]],
                                                 expected: str | None) -> None:
    assert propagate.tracestate(headers) == expected


@pytest.mark.parametrize(("headers", "expected"), [
    ([("traceparent", GOOD)], (("traceparent", GOOD),)),
    ([("traceparent", GOOD), ("tracestate", "a=1")],
     (("traceparent", GOOD), ("tracestate", "a=1"))),
    ([("traceparent", GOOD), ("tracestate", "bad state")], (("traceparent", GOOD),)),
    ([("traceparent", "00-bad"), ("tracestate", "a=1")], ()),  # state only with a parent
    ([("tracestate", "a=1")], ()),
    ([], ()),
])
def test_client_context_kept_only_when_well_formed(
        headers: list[tuple[str, str]], expected: tuple[tuple[str, str], ...]) -> None:
    assert propagate.client_context(headers) == expected


@pytest.mark.parametrize(("forwarded", "context", "expected"), [
    ([("accept", "*/*"), ("traceparent", "00-bad"), ("TraceState", "x=1")],
     [("traceparent", GOOD)], [("accept", "*/*"), ("traceparent", GOOD)]),
    ([("traceparent", GOOD)], [], []),
    ([("content-type", "application/json")], [],
     [("content-type", "application/json")]),
])
def test_upstream_drops_the_clients_trace_headers(
        forwarded: list[tuple[str, str]], context: list[tuple[str, str]],
        expected: list[tuple[str, str]]) -> None:
    assert propagate.upstream(forwarded, context) == expected


def record(**kw: object) -> UsageRecord:
    base: dict[str, object] = dict(
        ts=0.0, request_id="r1", tenant=None, model="m", replica="a", route="prefix",
        stream=False, status=200, prompt_tokens=100, cached_tokens=64,
        predicted_cached_tokens=48, best_available_tokens=64, completion_tokens=7,
        ttft_ms=12.5, latency_ms=30.0, session="client-session-id")
    base.update(kw)
    return UsageRecord(**base)  # type: ignore[arg-type]


def finding(kind: str) -> Finding:
    return Finding(kind=kind, severity="info", evidence="pattern", message_index=0,
                   role="system", char_offset=0, span="<x>", tokens_at_risk=1, session=None)


@pytest.mark.parametrize(("rec", "cls", "queued", "expected", "absent"), [
    (record(), "normal", None,
     {"gen_ai.request.model": "m", "gen_ai.usage.input_tokens": 100,
      "gen_ai.usage.output_tokens": 7, "gen_ai.usage.cache_read.input_tokens": 64,
      "gateway.cache.predicted_tokens": 48, "gateway.cache.delivered_tokens": 64,
      "gateway.route": "prefix", "gateway.replica": "a", "gateway.admission.class": "normal",
      "http.response.status_code": 200},
     {"gateway.admission.queued_ms", "gateway.tenant", "gateway.hygiene.findings",
      "error.type"}),
    (record(tenant="team-a", findings=(finding("uuid"), finding("timestamp"),
                                       finding("uuid")), hygiene=3),
     "low", 12.0,
     {"gateway.tenant": "team-a", "gateway.hygiene.findings": ("timestamp", "uuid"),
      "gateway.hygiene.finding_count": 3, "gateway.admission.queued_ms": 12.0,
      "gateway.admission.class": "low"}, set()),
    (record(status=503, replica=None, route=None, prompt_tokens=None, cached_tokens=None,
            completion_tokens=None, error="no healthy replica"), None, None,
     {"http.response.status_code": 503, "error.type": "no healthy replica"},
     {"gateway.replica", "gateway.route", "gen_ai.usage.input_tokens",
      "gen_ai.usage.cache_read.input_tokens", "gateway.admission.class"}),
    (record(endpoint="/v1/models", model="unknown"), None, None, {},
     {"gen_ai.request.model"}),
    # P/D: delivered is P's own hits (900 reported, 300 of them pulled back from D)
    (record(replica="d", prefill_replica="p", cached_from="decoder_kv", cached_tokens=900,
            prefill_cached_tokens=900, pulled_tokens=300, pulled_exact=False), None, None,
     {"gen_ai.usage.cache_read.input_tokens": 900, "gateway.cache.delivered_tokens": 600,
      "gateway.cache.pulled_tokens": 300, "gateway.pd.prefill_replica": "p"}, set()),
    (record(), None, None, {}, {"gateway.cache.pulled_tokens", "gateway.pd.prefill_replica"}),
])
def test_end_attributes(rec: UsageRecord, cls: str | None, queued: float | None,
                        expected: dict[str, object], absent: set[str]) -> None:
    got = end_attributes(rec, cls, queued)
    assert {k: got.get(k) for k in expected} == expected
    assert not absent & set(got)
    assert "client-session-id" not in repr(got)  # the client's session id stays out


@pytest.mark.parametrize(("endpoint", "model", "name", "operation"), [
    ("chat", "m", "chat m", "chat"), ("completions", "m", "text_completion m",
                                      "text_completion"),
    ("responses", None, "chat", "chat"), ("messages", "m", "chat m", "chat"),
    ("/v1/models", None, "gateway forward", None),
])
def test_span_name_and_operation(endpoint: str, model: str | None, name: str,
                                 operation: str | None) -> None:
    assert span_name(endpoint, model) == name
    assert start_attributes(endpoint, "POST", model).get("gen_ai.operation.name") == operation


@pytest.mark.parametrize(("env", "expected"), [
    ({}, "http/protobuf"), ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "grpc"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, "http/protobuf"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, ValueError),
])
def test_protocol(env: dict[str, str], expected: object) -> None:
    if expected is ValueError:
        with pytest.raises(ValueError, match="http/protobuf"):
            protocol(env)
    else:
        assert protocol(env) == expected


def test_settings_section_and_bounds() -> None:
    s = parse_settings(None, {"GATEWAY_TRACING__ENABLED": "true",
                              "GATEWAY_TRACING__MAX_QUEUE": "64"})
    assert s.tracing == TracingSettings(enabled=True, max_queue=64)
    assert parse_settings(None, {}).tracing.enabled is False
    with pytest.raises(SettingsError, match="max_queue"):
        parse_settings("[tracing]\nmax_queue = 0\n", {})


def test_enabled_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # not installed
    with pytest.raises(MissingExtra, match=r"cache-gateway\[otel\]"):
        request_tracer(TracingSettings(enabled=True), {}, CollectorRegistry())
    assert isinstance(request_tracer(TracingSettings(), {}, CollectorRegistry()), Passthrough)


# the endpoint picker --------------------------------------------------------------------

def mutation(routed_headers: Sequence[tuple[str, str]], remove: Sequence[str],
             ) -> tuple[dict[str, str], list[str]]:
    out = messages.routed("10.0.0.1:8000", body_phase=True, headers=routed_headers,
                          remove=remove)
    m = out.request_body.response.header_mutation
    return ({o.header.key: o.header.raw_value.decode() for o in m.set_headers},
            list(m.remove_headers))


async def test_picker_sets_the_gateway_spans_context(monkeypatch: pytest.MonkeyPatch) -> None:
    with Receiver().serving() as receiver:
        for k in [k for k in os.environ if k.startswith("OTEL_")]:
            monkeypatch.delenv(k)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        config = dataclasses.replace(settings(), tracing=TracingSettings(enabled=True))
        app = create_app(config, upstream=Fake().upstream)
        async with app.running():
            assert app.services is not None
            picker = Picker(app.services, EppSettings(port=0), time.perf_counter)
            flow = picker.start({":path": "/v1/chat/completions", ":method": "POST",
                                 "traceparent": GOOD, "tracestate": "bad state"})
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            routed = await picker.route(flow, orjson.dumps(body), None)
            picker.response_started(flow, 200, picker.endpoints["a"], "application/json")
            picker.finish(flow)
            span = receiver.wait_for(lambda s: s.trace_id == TID)
        assert span.parent_span_id == PID and span.kind == 2
        assert span.attributes["gateway.replica"] == "a"  # where the data plane served it
        sent = dict(routed.trace)
        assert sent["traceparent"] == f"00-{TID}-{span.span_id}-01"
        headers, removed = mutation(routed.trace, routed.untrace)
        assert headers["traceparent"] == sent["traceparent"]
        assert "tracestate" in removed  # the client's unchecked state is not forwarded


async def test_picker_tracing_off_removes_a_malformed_traceparent() -> None:
    app = create_app(settings(), upstream=Fake().upstream)
    async with app.running():
        assert app.services is not None
        picker = Picker(app.services, EppSettings(port=0), time.perf_counter)
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        for parent, kept in (("00-bad", ()), (GOOD, (("traceparent", GOOD),))):
            flow = picker.start({":path": "/v1/chat/completions", ":method": "POST",
                                 "traceparent": parent})
            routed = await picker.route(flow, body, None)
            picker.finish(flow)
            assert routed.trace == kept
            headers, removed = mutation(routed.trace, routed.untrace)
            assert ("traceparent" in removed) is (not kept)
            assert headers.get("traceparent") == (GOOD if kept else None)
