"""A body's `priority` never reaches a replica as the client wrote it: on every endpoint the
gateway forwards, the replica receives the class the gateway granted (vLLM's priority for
it, where every replica the request may try runs priority scheduling) or no `priority` at
all (vLLM's default 0, `normal`), whatever the client sent, admission on or off."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.priority import stamp
from gateway.proxy.app import create_app
from gateway.settings import AuthSettings
from gateway.usage.record import UsageRecord
from tests.proxy_fakes import MODEL, Fake, settings, started

# What a client may write: the attack (-100), other numbers, other types, and nothing.
SENT: list[Any] = [-100, -1, 0, 1, 7, 2**70, -1.5, "high", True, None, [], {"x": 1}]
ABSENT = object()

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions",
             {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}]}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "hello " * 40}),
    "responses": ("/v1/responses", {"model": MODEL, "input": "hello " * 40}),
    "messages": ("/v1/messages", {"model": MODEL, "max_tokens": 8,
                                  "messages": [{"role": "user", "content": "hello " * 40}]}),
    "pooling (forwarded)": ("/pooling", {"model": MODEL, "input": "hello"}),
}

# (admission, replicas with priority scheduling) -> what a `normal`-capped key asking
# `high` is granted on the wire, per endpoint kind: routed (chat..responses) or not.
MODES = {
    "admission off": (False, ()),
    "admission on, no priority replicas": (True, ()),
    "admission on, priority replicas": (True, ("a", "b")),
}


@pytest.mark.parametrize(("sent", "engine", "changed"), [
    (-100, None, True), (-100, 0, True), (-100, -1, True), (0, 0, False), (0, None, True),
    (True, 1, True), (1.0, 1, True), ("1", 1, True), (ABSENT, None, False),
    (ABSENT, -1, True), (-1, -1, False),
])
def test_stamp(sent: Any, engine: int | None, changed: bool) -> None:
    body: dict[str, Any] = {"model": "m"}
    if sent is not ABSENT:
        body["priority"] = sent
    assert stamp(body, engine) is changed
    assert body.get("priority", ABSENT) == (ABSENT if engine is None else engine)
    assert type(body.get("priority", 0)) is int


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("endpoint", list(BODIES))
async def test_a_normal_capped_key_never_sets_its_own_priority(endpoint: str,
                                                               mode: str) -> None:
    enabled, prio = MODES[mode]
    cfg = dataclasses.replace(
        settings(), auth=AuthSettings(keys={"k-user": "team", "k-vip": "vip"}),
        admission=AdmissionConfig(enabled=enabled, priority_replicas=prio,
                                  priority_caps={"vip": "high"}))
    fake = Fake()
    app = create_app(cfg, upstream=fake.upstream)
    path, body = BODIES[endpoint]
    records: list[UsageRecord] = []
    async for client in started(app, records):
        for key, asked in (("k-user", None), ("k-user", "high"), ("k-vip", "high")):
            for value in SENT:
                headers = {"authorization": f"Bearer {key}"}
                if asked:
                    headers["x-gateway-priority"] = asked
                sent = {**body, "priority": value} if value is not None else body
                r = await client.post(path, json=sent, headers=headers)
                assert r.status_code == 200, r.text
    seen = [orjson.loads(req.body or b"{}") for req in fake.inference_requests()]
    assert len(seen) == 3 * len(SENT)
    got = [b.get("priority", "absent") for b in seen]
    routed = endpoint != "pooling (forwarded)"
    # only a granted `high` on replicas that all schedule by priority carries one
    vip = -1 if routed and enabled and prio else "absent"
    assert got == ["absent"] * (2 * len(SENT)) + [vip] * len(SENT)
