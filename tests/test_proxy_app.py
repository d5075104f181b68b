"""The gateway app in process: httpx.ASGITransport against `create_app` with a MockUpstream
standing in for the replicas (relay, headers, usage injection, records, routes, hygiene logs).
Errors, auth and retries are in test_proxy_app_errors.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from gateway.proxy.app import create_app
from gateway.usage.record import UsageRecord
from tests.proxy_fakes import (
    COMPLETION,
    DONE,
    EVENTS,
    MODEL,
    USAGE_EVENT,
    Behavior,
    Fake,
    chat,
    ok_json,
    ok_stream,
    settings,
    started,
)


@pytest.fixture
def records() -> list[UsageRecord]:
    return []


async def test_non_streaming_relay_headers_and_record(records: list[UsageRecord]) -> None:
    fake = Fake()
    app = create_app(settings(), upstream=fake.upstream)
    raw = orjson.dumps(chat(user="alice"))
    async for client in started(app, records):
        r = await client.post("/v1/chat/completions", content=raw,
                              headers={"x-request-id": "rid-1"})
        assert r.status_code == 200
        assert r.content == COMPLETION
        assert r.headers["x-request-id"] == "rid-1"
        assert r.headers["x-gateway-replica"] in ("a", "b")
        assert r.headers["x-gateway-route"]
        assert r.headers["content-type"] == "application/json"
    (sent,) = fake.inference_requests()
    assert sent.body == raw  # original bytes, untouched
    # the engine gets the gateway's own random id, never the client's (no collisions)
    assert sent.headers["x-request-id"] == r.headers["x-gateway-request-id"] != "rid-1"
    assert len(sent.headers["x-request-id"]) == 32
    assert "authorization" not in sent.headers
    (rec,) = records
    assert (rec.request_id, rec.status, rec.model, rec.session, rec.stream) == (
        "rid-1", 200, MODEL, "alice", False)
    assert rec.engine_request_id == sent.headers["x-request-id"]  # found in vLLM's logs
    assert (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens) == (40, 32, 2)
    assert rec.replica == r.headers["x-gateway-replica"]
    assert rec.route == r.headers["x-gateway-route"]
    assert rec.predicted_cached_tokens is not None and rec.best_available_tokens is not None
    assert rec.ttft_ms is not None and rec.latency_ms >= rec.ttft_ms


@pytest.mark.parametrize(("behave", "stream", "reply"), [
    (ok_json, False, "hi"),  # the assistant message of the parsed body
    (ok_stream, True, None),  # streams: token events are not parsed (tap stays cheap)
])
async def test_router_gets_the_reply_text(records: list[UsageRecord], behave: Behavior,
                                          stream: bool, reply: str | None) -> None:
    fake = Fake(behave)
    app = create_app(settings(), upstream=fake.upstream)
    seen: list[tuple[Any, ...]] = []
    async for client in started(app, records):
        assert app.services is not None
        router = app.services.router

        def spy(plan: Any, now: float,
                _original: Callable[..., None] = router.report) -> None:
            o = plan.outcome
            seen.append((o.replica, o.prompt_tokens, o.cached_tokens, o.ok, o.reply_text,
                         o.completion_tokens, o.first_token_at is not None))
            _original(plan, now)

        router.report = spy  # type: ignore[method-assign]
        r = await client.post("/v1/chat/completions", json=chat(stream=stream))
        assert r.status_code == 200
    ((replica, prompt, cached, ok, text, completion, first_token),) = seen  # reported once
    assert replica == r.headers["x-gateway-replica"] and first_token
    assert (prompt, cached, ok, text, completion) == (40, 32 if not stream else 16, True,
                                                      reply, 2)


@pytest.mark.parametrize("client_usage", [False, True])
async def test_streaming_usage_injection(records: list[UsageRecord], client_usage: bool) -> None:
    fake = Fake(ok_stream)
    app = create_app(settings(), upstream=fake.upstream)
    options = {"stream_options": {"include_usage": True}} if client_usage else {}
    body = chat(stream=True, **options)
    raw = orjson.dumps(body)
    async for client in started(app, records):
        r = await client.post("/v1/chat/completions", content=raw)
        assert r.status_code == 200
        assert r.headers["x-sim-timing"] == "q=1"
        expected = [*EVENTS, *([USAGE_EVENT] if client_usage else []), DONE]
        assert r.content == b"".join(expected)
    (sent,) = fake.inference_requests()
    if client_usage:
        assert sent.body == raw
    else:
        assert orjson.loads(sent.body or b"")["stream_options"] == {"include_usage": True}
    (rec,) = records
    assert (rec.stream, rec.prompt_tokens, rec.cached_tokens) == (True, 40, 16)


def test_session_header_wins() -> None:
    from gateway.sessions import resolve_session

    assert resolve_session(b"s-h", {"prompt_cache_key": "k", "user": "u"}) == "s-h"
    assert resolve_session(None, {"prompt_cache_key": "k", "user": "u"}) == "k"
    assert resolve_session(b"", {"prompt_cache_key": "", "user": "u"}) == "u"
    assert resolve_session(None, {"user": 3}) is None


async def test_models_union_and_other_routes(records: list[UsageRecord]) -> None:
    fake = Fake(models={"a": ["m1", "m2"], "b": ["m2", "m3"]})
    app = create_app(settings(), upstream=fake.upstream)
    async for client in started(app, records):
        models = (await client.get("/v1/models")).json()
        assert sorted(c["id"] for c in models["data"]) == ["m1", "m2", "m3"]
        r = await client.post("/v1/chat/completions", json=chat(model="m3"))
        assert r.headers["x-gateway-replica"] == "b"
        r = await client.post("/v1/chat/completions", json=chat(model="m1"))
        assert r.headers["x-gateway-replica"] == "a"
        metrics = await client.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert b"gateway_requests_total" in metrics.content
        stats = (await client.get("/stats")).json()
        # the two chat requests above, and both replicas with their scrape state
        assert stats["windows"]["1m"]["requests"] == 2
        assert set(stats["replicas"]) == {"a", "b"}
        ready = (await client.get("/ready")).json()
        assert ready["healthy"] == ["a", "b"]
        r = await client.post("/v1/embeddings", json={"model": "m3", "input": "x"})
        assert r.headers["x-gateway-replica"] == "b"
        assert (await client.get("/nope")).status_code == 404
    assert [r.endpoint for r in records] == ["chat", "chat", "/v1/embeddings"]


@pytest.mark.parametrize(("tail_words", "severity", "level"), [
    (400, "warning", logging.WARNING),  # a long prompt behind the break: it costs
    (0, "info", logging.DEBUG),  # a short one: info, logged at debug
])
async def test_hygiene_findings_log_at_their_severity(
    records: list[UsageRecord], caplog: pytest.LogCaptureFixture, tail_words: int,
    severity: str, level: int,
) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    system = f"You are helpful. Current time: {stamp}. " + "word " * tail_words
    body = {"model": MODEL, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": "hi"}]}
    app = create_app(settings(), upstream=Fake().upstream)
    with caplog.at_level(logging.DEBUG, logger="gateway.hygiene"):
        async for client in started(app, records):
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    logged = [r for r in caplog.records if r.getMessage() == "hygiene finding"]
    assert logged and {r.__dict__["severity"] for r in logged} == {severity}
    assert {r.levelno for r in logged} == {level}


SPOOFED = [("X-Gateway-Replica", "evil"), ("x-gateway-cache", "route=prefix, predicted=999999"),
           ("x-gateway-route", "spoofed"), ("x-gateway-queue-ms", "0.0"),
           ("x-gateway-request-id", "spoofed"), ("x-request-id", "spoofed"),
           ("x-engine-note", "kept")]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_replicas_own_gateway_headers_never_reach_the_client(
        records: list[UsageRecord], stream: bool) -> None:
    """Only the gateway sets `x-gateway-*` (and `x-request-id`): a replica that sends its
    own cannot make a client believe another route, replica or cache prediction."""
    def spoofing(replica: str, req: Any) -> Any:
        reply = (ok_stream if stream else ok_json)(replica, req)
        reply.headers = [*reply.headers, *SPOOFED]
        return reply

    app = create_app(settings(), upstream=Fake(spoofing).upstream)
    async for client in started(app, records):
        r = await client.post("/v1/chat/completions", content=orjson.dumps(chat(stream=stream)),
                              headers={"x-request-id": "rid-1"})
        assert r.status_code == 200
    values = {k.lower(): r.headers.get_list(k) for k, _ in SPOOFED}
    assert values["x-gateway-replica"] in (["a"], ["b"])
    assert values["x-gateway-route"] == [records[0].route] != ["spoofed"]
    assert len(values["x-gateway-cache"]) == 1 and "999999" not in values["x-gateway-cache"][0]
    assert values["x-gateway-queue-ms"] == []  # it never waited: the gateway sets none
    assert values["x-gateway-request-id"] == [records[0].engine_request_id]
    assert values["x-request-id"] == ["rid-1"]
    assert values["x-engine-note"] == ["kept"]  # any other header of the replica's is relayed



@pytest.mark.parametrize("rid", ["r" * 129, "r" * 8000, "a b"])
async def test_an_unusable_client_request_id_is_replaced(records: list[UsageRecord],
                                                         rid: str) -> None:
    app = create_app(settings(), upstream=Fake().upstream)
    async for client in started(app, records):
        r = await client.post("/v1/chat/completions", content=orjson.dumps(chat()),
                              headers={"x-request-id": rid})
        assert r.status_code == 200
    (rec,) = records
    assert r.headers["x-request-id"] == rec.request_id != rid
    assert len(rec.request_id) <= 128
