"""The gateway app in process, failure paths: OpenAI-shaped errors, no healthy replica,
client and replica keys, retry on the next replica before the first byte, and a stream that
breaks after it."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from gateway.proxy.app import create_app
from gateway.proxy.errors import UpstreamConnectError, UpstreamTimeout
from gateway.settings import ReplicaSettings
from gateway.usage.record import UsageRecord
from tests.proxy_fakes import (
    COMPLETION,
    EVENTS,
    JSON_H,
    MODEL,
    SSE_H,
    Behavior,
    Fake,
    chat,
    ok_json,
    settings,
    started,
)
from tests.upstream_double import MockReply, MockRequest


@pytest.fixture
def records() -> list[UsageRecord]:
    return []


def _error_cases() -> list[tuple[str, dict[str, Any], Behavior, bytes | None, dict[str, str],
                                  int, str | None]]:
    def refuse(replica: str, req: MockRequest) -> MockReply:
        raise UpstreamConnectError("refused")

    def timeout(replica: str, req: MockRequest) -> MockReply:
        raise UpstreamTimeout("slow")

    def engine_400(replica: str, req: MockRequest) -> MockReply:
        return MockReply(400, JSON_H, [b'{"error":{"message":"too long","code":400}}'])

    return [
        # (name, server settings, behavior, body, headers, status, param)
        ("invalid json", {}, ok_json, b"{nope", {}, 400, None),
        ("not an object", {}, ok_json, b"[1]", {}, 400, None),
        ("model type", {}, ok_json, orjson.dumps({"model": 1, "messages": []}), {}, 400, "model"),
        ("model missing", {}, ok_json, orjson.dumps({"messages": []}), {}, 400, "model"),
        ("messages type", {}, ok_json, orjson.dumps({"model": MODEL, "messages": {}}), {}, 400,
         "messages"),
        ("message item", {}, ok_json, orjson.dumps({"model": MODEL, "messages": [1]}), {}, 400,
         "messages[0]"),
        ("stream type", {}, ok_json, orjson.dumps(chat(stream="yes")), {}, 400, "stream"),
        ("stream_options type", {}, ok_json, orjson.dumps(chat(stream_options=[])), {}, 400,
         "stream_options"),
        ("unknown model", {}, ok_json, orjson.dumps(chat(model="zzz")), {}, 404, "model"),
        ("too large", {"max_body_bytes": 100}, ok_json, orjson.dumps(chat()), {}, 413, None),
        ("connect error everywhere", {}, refuse, orjson.dumps(chat()), {}, 502, None),
        ("timeout", {}, timeout, orjson.dumps(chat()), {}, 504, None),
        ("engine error passes", {}, engine_400, orjson.dumps(chat()), {}, 400, None),
    ]


@pytest.mark.parametrize(("name", "server", "behave", "body", "headers", "status", "param"),
                         _error_cases())
async def test_errors(
    records: list[UsageRecord], name: str, server: dict[str, Any], behave: Behavior,
    body: bytes, headers: dict[str, str], status: int, param: str | None,
) -> None:
    app = create_app(settings(**server), upstream=Fake(behave).upstream)
    async for client in started(app, records):
        r = await client.post("/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == status, name
    error = r.json()["error"]
    if name == "engine error passes":
        assert r.content == b'{"error":{"message":"too long","code":400}}'
    else:
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param
    assert len(records) == 1 and records[0].status == status


async def test_no_healthy_replica_is_503(records: list[UsageRecord]) -> None:
    app = create_app(settings(), upstream=Fake(down=("a", "b")).upstream)
    async for client in started(app, records):
        assert (await client.get("/ready")).status_code == 503
        r = await client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_healthy_replica"
        assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize(
    ("keys", "authorization", "status", "tenant"),
    [
        ({}, None, 200, None),
        ({"k1": "team-a", "k2": "team-b"}, "Bearer k2", 200, "team-b"),
        ({"k1": "team-a"}, None, 401, None),
        ({"k1": "team-a"}, "Bearer k1x", 401, None),
        ({"k1": "team-a"}, "Basic k1", 401, None),
    ],
)
async def test_auth(records: list[UsageRecord], keys: dict[str, str], authorization: str | None,
                    status: int, tenant: str | None) -> None:
    from gateway.settings import AuthSettings

    fake = Fake()
    s = dataclasses.replace(settings(), auth=AuthSettings(keys=keys))
    app = create_app(s, upstream=fake.upstream)
    headers = {"authorization": authorization} if authorization else {}
    async for client in started(app, records):
        r = await client.post("/v1/chat/completions", json=chat(), headers=headers)
    assert r.status_code == status
    assert records[0].tenant == tenant
    for sent in fake.inference_requests():
        assert "authorization" not in sent.headers  # client keys never go upstream


@pytest.mark.parametrize(
    ("keys", "public_metrics", "authorization", "expected"),
    [
        ({}, False, None, {"/v1/models": 200, "/metrics": 200, "/stats": 200}),
        ({"k1": "team-a"}, False, None, {"/v1/models": 401, "/metrics": 401, "/stats": 401}),
        ({"k1": "team-a"}, False, "Bearer k1", {"/v1/models": 200, "/metrics": 200,
                                                "/stats": 200}),
        ({"k1": "team-a"}, True, None, {"/v1/models": 401, "/metrics": 200, "/stats": 200}),
        ({"k1": "team-a"}, False, "Bearer nope", {"/v1/models": 401, "/metrics": 401,
                                                  "/stats": 401}),
    ],
)
async def test_keys_guard_the_gateways_own_routes(
    keys: dict[str, str], public_metrics: bool, authorization: str | None,
    expected: dict[str, int],
) -> None:
    from gateway.settings import AuthSettings

    s = dataclasses.replace(settings(), auth=AuthSettings(keys=keys,
                                                          public_metrics=public_metrics))
    app = create_app(s, upstream=Fake().upstream)
    headers = {"authorization": authorization} if authorization else {}
    async for client in started(app, []):
        got = {path: (await client.get(path, headers=headers)).status_code for path in expected}
        for path in ("/health", "/ready"):  # probes never need a key
            assert (await client.get(path)).status_code == 200
        r = await client.get("/stats", headers=headers)
    assert got == expected
    if r.status_code == 401:
        assert "team-a" not in r.text and r.json()["error"]["code"] == "invalid_api_key"


async def test_replica_key_goes_upstream() -> None:
    fake = Fake()
    replicas = (ReplicaSettings(name="a", url="http://a.test", api_key="up-secret"),)
    app = create_app(dataclasses.replace(settings(), replicas=replicas), upstream=fake.upstream)
    async for client in started(app, []):
        r = await client.post("/v1/chat/completions", json=chat(),
                              headers={"authorization": "Bearer client"})
        assert r.status_code == 200
    assert fake.inference_requests()[0].headers["authorization"] == "Bearer up-secret"


async def test_not_delivered_moves_to_the_next_replica_which_stays_healthy(
    records: list[UsageRecord],
) -> None:
    tried: list[str] = []

    def first_refused(replica: str, req: MockRequest) -> MockReply:
        tried.append(replica)
        if len(tried) == 1:
            raise UpstreamConnectError("refused")
        return MockReply(200, JSON_H, [COMPLETION])

    app = create_app(settings(), upstream=Fake(first_refused).upstream)
    async for client in started(app, records):
        r = await client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200
        assert r.headers["x-gateway-replica"] == tried[1] != tried[0]
        assert app.services is not None
        assert all(x.in_flight == 0 for x in app.services.fleet.replicas.values())
        # one refused request is not a verdict: its probe (the mock's /health answers) wins
        healthy = {x.name for x in app.services.fleet.healthy()}
    assert healthy == {"a", "b"}
    assert len(records) == 1 and records[0].replica == tried[1]


async def test_a_5xx_is_relayed_and_not_sent_elsewhere(records: list[UsageRecord]) -> None:
    tried: list[str] = []

    def first_500(replica: str, req: MockRequest) -> MockReply:
        tried.append(replica)
        return MockReply(500, JSON_H, [b'{"error":{"message":"boom","code":500}}'])

    app = create_app(settings(), upstream=Fake(first_500).upstream)
    async for client in started(app, records):
        r = await client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 500 and r.content == b'{"error":{"message":"boom","code":500}}'
    assert len(tried) == 1 and r.headers["x-gateway-replica"] == tried[0]


async def test_last_upstream_5xx_passes_through(records: list[UsageRecord]) -> None:
    def always_503(replica: str, req: MockRequest) -> MockReply:
        return MockReply(503, JSON_H, [b'{"error":{"message":"busy","code":503}}'])

    app = create_app(settings(), upstream=Fake(always_503).upstream)
    async for client in started(app, records):
        r = await client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 503
    assert r.content == b'{"error":{"message":"busy","code":503}}'


async def test_failure_after_first_byte_ends_stream_with_error_event(
    records: list[UsageRecord],
) -> None:
    fake = Fake(lambda replica, req: MockReply(200, SSE_H, [EVENTS[0], EVENTS[2][:20]]))
    # the inference answers (a health probe may follow: with the queue on, an answer
    # without usage has the replica probed, gateway/admission/fleetview.py `doubt`)
    posted: list[Any] = []

    app = create_app(settings(), upstream=fake.upstream)

    async def broken_chunks() -> AsyncIterator[bytes]:
        yield EVENTS[0]
        yield EVENTS[2][:20]
        raise UpstreamTimeout("stalled")

    send = fake.upstream.send

    async def send_broken(*args: Any, **kwargs: Any) -> Any:
        resp = await send(*args, **kwargs)
        if args[0] == "POST":
            resp.chunks = broken_chunks  # type: ignore[method-assign]
            posted.append(resp)
        return resp

    async for client in started(app, records):
        fake.upstream.send = send_broken  # type: ignore[method-assign]
        r = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert r.status_code == 200
    text = r.content
    assert text.startswith(EVENTS[0])
    tail = text.split(b"\n\n")
    assert tail[-3].startswith(b'data: {"error":')
    assert tail[-2] == b"data: [DONE]"
    assert records[0].status == 504 and records[0].error
    assert len(posted) == 1 and posted[0].aborted
