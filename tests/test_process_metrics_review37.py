"""Outside review of issue 37's process metrics: `/metrics` of a gateway with every
optional part that registers series on (tracing's span counters, the admission queue,
the DNS source) has no `*_created` sample, and a fleet that scales does not grow it."""

from __future__ import annotations

import dataclasses
import os

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.proxy.app import create_app
from gateway.tracing.config import TracingSettings
from tests.otlp_receiver import Receiver
from tests.proxy_fakes import Fake, chat, settings, started

pytest.importorskip("opentelemetry.sdk.trace")


async def test_no_created_samples_with_tracing_and_admission_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with Receiver().serving() as receiver:
        for k in [k for k in os.environ if k.startswith("OTEL_")]:
            monkeypatch.delenv(k)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
        s = dataclasses.replace(settings(), tracing=TracingSettings(enabled=True),
                                admission=AdmissionConfig(enabled=True))
        async for client in started(create_app(s, upstream=Fake().upstream), []):
            for _ in range(3):
                assert (await client.post("/v1/chat/completions", json=chat())).status_code \
                    == 200
            text = (await client.get("/metrics")).text
    assert "gateway_trace_spans_dropped_total" in text  # tracing's counters are there
    assert "process_cpu_seconds_total" in text
    created = sorted({line.split("{")[0].split(" ")[0] for line in text.splitlines()
                      if "_created" in line and not line.startswith("#")})
    assert created == [], created
