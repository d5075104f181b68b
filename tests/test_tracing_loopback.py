"""Tracing through a real `gateway serve` on loopback: its spans exported over OTLP/HTTP to
a receiver the test runs (tests/otlp_receiver.py decodes the protobuf messages), the
replica a recording one (tests/recording_replica.py: every request head it got).

Shown: one server span per request with the route, replica, cache, hygiene, admission and
GenAI attributes; a client's traceparent continued; the replica sent the gateway span's
context (its parent is the gateway's span), never a client's malformed traceparent, and no
tenant's key or prompt in a span; with the collector down, requests answered as usual and
the spans dropped counted; with tracing off, only a well formed traceparent forwarded."""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.otlp_receiver import Receiver, Span
from tests.recording_replica import Recorder
from tests.servers import free_port, gateway

pytest.importorskip("opentelemetry.sdk.trace")

BASE = {"GATEWAY_HEALTH_INTERVAL_S": "0.2", "GATEWAY_USAGE__STARTUP_PROBE": "false",
        "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_SERVICE_NAME": "gateway-under-test"}
KEYS = "sk-tenant-a-secret=team-a,sk-tenant-b-secret=team-b"
SECRET_PROMPT = "the tenant's own words 7f3e"
# a uuid a hygiene finding names (gateway.hygiene): its kind goes in the span
SYSTEM = "trace 123e4567-e89b-12d3-a456-426614174000. You are terse."
TRACEPARENT = re.compile(rb"\r\ntraceparent: (00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2})\r\n",
                         re.IGNORECASE)


def chat(url: str, text: str, headers: dict[str, str]) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r



def upstream_of(rec: Recorder, gateway_request_id: str) -> bytes:
    found = [head for line, head in rec.requests
             if line.startswith(b"POST ") and
             f"x-request-id: {gateway_request_id}".encode() in head.lower()]
    assert len(found) == 1, rec.requests
    return found[0]


def joined(sent: list[bytes], trace_id: str, parent_id: str) -> bool:
    """One traceparent, in trace `trace_id`, child of `parent_id`, sampled (the SDK may
    set W3C level 2's random flag too on a trace it starts)."""
    return (len(sent) == 1 and sent[0][:52] == f"00-{trace_id}-{parent_id}".encode()
            and int(sent[0][-2:], 16) & 1 == 1)


def random_id(n: int) -> str:
    return os.urandom(n).hex()


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[str, Recorder, Receiver]]:
    with Receiver().serving() as receiver, Recorder().serving() as rec:
        env = {**BASE, "GATEWAY_TRACING__ENABLED": "true", "GATEWAY_AUTH__KEYS": KEYS,
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}"}
        with gateway([f"http://127.0.0.1:{rec.port}"], env=env) as url:
            yield url, rec, receiver


def span_of(receiver: Receiver, response: httpx.Response) -> Span:
    rid = response.headers["x-request-id"]
    return receiver.wait_for(lambda s: s.attributes.get("gateway.request_id") == rid)


def test_span_continues_the_clients_trace_and_the_replica_joins_it(
        traced: tuple[str, Recorder, Receiver]) -> None:
    url, rec, receiver = traced
    trace_id, parent = random_id(16), random_id(8)
    r = httpx.post(url + "/v1/chat/completions", timeout=30, headers={
        "authorization": "Bearer sk-tenant-a-secret",
        "traceparent": f"00-{trace_id}-{parent}-01", "tracestate": "vendor=abc"},
        json={"model": "m", "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    span = span_of(receiver, r)
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent)
    assert span.kind == 2 and span.name == "chat m"  # SERVER; "{operation} {model}"
    assert span.service == "gateway-under-test"  # OTEL_SERVICE_NAME
    a = span.attributes
    assert a["gen_ai.request.model"] == "m"
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "vllm"
    assert a["gen_ai.usage.input_tokens"] == 10  # the recording replica's usage
    assert a["gen_ai.usage.output_tokens"] == 1
    assert a["gen_ai.usage.cache_read.input_tokens"] == 0
    assert a["gateway.cache.delivered_tokens"] == 0
    assert isinstance(a["gateway.cache.predicted_tokens"], int)
    assert a["gateway.route"] == r.headers["x-gateway-route"]
    assert a["gateway.replica"] == f"127.0.0.1:{rec.port}"
    assert a["gateway.admission.class"] == "normal"
    assert a["http.response.status_code"] == 200
    assert a["gateway.tenant"] == "team-a"
    assert "uuid" in a["gateway.hygiene.findings"]
    # the replica got the gateway span's context: same trace, the gateway span its parent
    head = upstream_of(rec, r.headers["x-gateway-request-id"])
    sent = TRACEPARENT.findall(head)
    assert sent == [f"00-{trace_id}-{span.span_id}-01".encode()]  # the client's flags
    assert parent.encode() not in head
    assert b"tracestate: vendor=abc" in head.lower()  # the client's state continued


def test_no_traceparent_starts_a_trace_the_replica_joins(
        traced: tuple[str, Recorder, Receiver]) -> None:
    url, rec, receiver = traced
    r = chat(url, "fresh", {"authorization": "Bearer sk-tenant-b-secret"})
    span = span_of(receiver, r)
    assert span.parent_span_id == ""  # a root span
    sent = TRACEPARENT.findall(upstream_of(rec, r.headers["x-gateway-request-id"]))
    assert joined(sent, span.trace_id, span.span_id)


@pytest.mark.parametrize("bad", [
    "00-XYZ-not-a-trace", "00-" + "0" * 32 + "-" + "1" * 16 + "-01",
    "ff-" + "a" * 32 + "-" + "b" * 16 + "-01", "00-" + "A" * 32 + "-" + "b" * 16 + "-01",
])
def test_malformed_traceparent_never_reaches_the_replica_nor_a_tenant_secret_a_span(
        traced: tuple[str, Recorder, Receiver], bad: str) -> None:
    url, rec, receiver = traced
    r = chat(url, SECRET_PROMPT, {"authorization": "Bearer sk-tenant-b-secret",
                                  "traceparent": bad})
    span = span_of(receiver, r)
    head = upstream_of(rec, r.headers["x-gateway-request-id"])
    assert bad.encode() not in head
    assert joined(TRACEPARENT.findall(head), span.trace_id, span.span_id)
    assert span.parent_span_id == "" and span.attributes["gateway.tenant"] == "team-b"
    flat = repr(span.attributes)
    for secret in ("sk-tenant-a-secret", "sk-tenant-b-secret", SECRET_PROMPT, "team-a"):
        assert secret not in flat


def metric(url: str, name: str, labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def wait_dropped(url: str, n: int) -> tuple[float, float]:
    """(queue_full, export_failed) once they add up to `n`, or as they are after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        full = metric(url, "gateway_trace_spans_dropped_total", 'reason="queue_full"')
        failed = metric(url, "gateway_trace_spans_dropped_total", 'reason="export_failed"')
        if full + failed >= n or time.monotonic() > deadline:
            return full, failed
        time.sleep(0.2)


def send(url: str, rec: Recorder, n: int) -> None:
    """`n` requests, each answered by the replica as if no tracing were there."""
    for i in range(n):
        r = chat(url, f"down {i}", {})
        assert r.json()["choices"][0]["message"]["content"].startswith("echo")
    assert len(rec.inference()) == n


def test_collector_down_requests_unaffected_spans_dropped_counted() -> None:
    dead = free_port()  # nothing listens there
    env = {**BASE, "GATEWAY_TRACING__ENABLED": "true", "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{dead}"}
    n = 6
    with Recorder().serving() as rec, gateway([f"http://127.0.0.1:{rec.port}"], env=env) as url:
        send(url, rec, n)
        assert wait_dropped(url, n) == (0, n)  # every export refused
        assert metric(url, "gateway_trace_spans_exported_total", "") == 0


def test_collector_hung_queue_bounded_the_rest_dropped_counted() -> None:
    # a collector that accepts connections and never answers: one export hangs for its
    # timeout while the queue (one span) is full, and every span after it is dropped
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        env = {**BASE, "GATEWAY_TRACING__ENABLED": "true", "GATEWAY_TRACING__MAX_QUEUE": "1",
               "OTEL_EXPORTER_OTLP_TIMEOUT": "5",
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{hung.getsockname()[1]}"}
        n = 6
        with Recorder().serving() as rec, gateway([f"http://127.0.0.1:{rec.port}"],
                                                  env=env) as url:
            started = time.monotonic()
            send(url, rec, n)
            sent_in = time.monotonic() - started
            full, failed = wait_dropped(url, n)
            if sent_in < 4:  # all sent while the first export hung (a loaded machine may not)
                assert (full, failed) == (n - 1, 1)
            assert full >= 1 and full + failed == n


def test_tracing_off_forwards_only_a_well_formed_traceparent() -> None:
    good = f"00-{random_id(16)}-{random_id(8)}-01"
    with Recorder().serving() as rec, gateway([f"http://127.0.0.1:{rec.port}"],
                                              env=BASE) as url:
        r = chat(url, "off good", {"traceparent": good, "tracestate": "v=1"})
        head = upstream_of(rec, r.headers["x-gateway-request-id"])
        assert TRACEPARENT.findall(head) == [good.encode()]
        assert b"tracestate: v=1" in head.lower()
        r = chat(url, "off bad", {"traceparent": "00-bad", "tracestate": "v=1"})
        head = upstream_of(rec, r.headers["x-gateway-request-id"])
        assert b"traceparent" not in head.lower() and b"tracestate" not in head.lower()
        assert "gateway_trace_spans" not in httpx.get(url + "/metrics", timeout=10).text
