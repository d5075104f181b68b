"""`gateway epp` with API keys: the endpoint picker keys its prefix index by tenant as
`gateway serve` does, so the prediction and route a key's answer carries count only what
its own tenant sent (the picker is driven directly; Envoy is not needed for this)."""

from __future__ import annotations

import dataclasses
import time

import orjson

from gateway.epp.picker import Picker
from gateway.proxy.app import create_app
from gateway.settings import AuthSettings, EppSettings
from gateway.usage.record import UsageRecord
from tests.proxy_fakes import Fake, chat, settings, started

PROMPT = "You are the payroll agent; the vault code is 4471. " * 40


async def test_a_second_tenant_is_predicted_nothing_of_the_firsts_prefix() -> None:
    cfg = dataclasses.replace(settings(), auth=AuthSettings(keys={"ka": "alice", "kb": "bob"}))
    app = create_app(cfg, upstream=Fake().upstream)
    raw = orjson.dumps(chat(messages=[{"role": "system", "content": PROMPT},
                                      {"role": "user", "content": "What is due?"}]))
    records: list[UsageRecord] = []
    async for _client in started(app, records):
        assert app.services is not None
        picker = Picker(app.services, EppSettings(port=0), time.perf_counter)
        told = []
        for key in ("ka", "ka", "kb"):
            flow = picker.start({":path": "/v1/chat/completions", ":method": "POST",
                                 "authorization": f"Bearer {key}"})
            await picker.route(flow, raw, None)
            told.append(dict(flow.added)["x-gateway-cache"])
    # alice's second request finds her first; bob's finds nothing of hers
    assert "predicted=0" not in told[1] and "route=cold" not in told[1], told
    assert told[2].startswith("route=cold, predicted=0"), told
