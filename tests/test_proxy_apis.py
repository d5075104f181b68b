"""The gateway app in process for /v1/responses and /v1/messages: input checks, response
affinity (remembered from bodies, continuation pinned, plain errors when the creator is
gone) and the usage record's endpoint."""

from __future__ import annotations

import datetime
from typing import Any

import orjson
import pytest

from gateway.proxy.app import create_app
from gateway.usage.record import UsageRecord
from tests.proxy_fakes import JSON_H, MODEL, Fake, settings, started
from tests.upstream_double import MockReply, MockRequest

# a timestamp near the app's clock (the analyzer flags times close to the request's)
NOW = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def responses_answer(replica: str, req: MockRequest) -> MockReply:
    body = orjson.dumps({
        "id": f"resp_{replica}{len(req.body or b'')}", "object": "response",
        "status": "completed", "output": [{"type": "message", "role": "assistant",
                                           "content": [{"type": "output_text", "text": "ok"}]}],
        "usage": {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32},
                  "output_tokens": 1}})
    return MockReply(200, JSON_H, [body])


def messages_answer(replica: str, req: MockRequest) -> MockReply:
    return MockReply(200, JSON_H, [orjson.dumps({
        "id": "chatcmpl-1", "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": "ok"}],
        "usage": {"input_tokens": 8, "output_tokens": 1, "cache_read_input_tokens": 32}})])


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/responses", {"model": MODEL}, "input"),
    ("/v1/responses", {"model": MODEL, "input": 3}, "input"),
    ("/v1/responses", {"model": MODEL, "input": "x", "instructions": []}, "instructions"),
    ("/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": 7},
     "previous_response_id"),
    ("/v1/responses", {"model": MODEL, "input": [{"type": "bogus"}]}, None),
    ("/v1/messages", {"model": MODEL}, "messages"),
    ("/v1/messages", {"model": MODEL, "messages": "hi"}, "messages"),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                      "system": 3}, "system"),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, None),
])
async def test_bad_input_is_an_openai_error(path: str, body: dict[str, Any],
                                            param: str | None) -> None:
    fake = Fake(responses_answer)
    records: list[UsageRecord] = []
    async for client in started(create_app(settings(), upstream=fake.upstream), records):
        r = await client.post(path, content=orjson.dumps(body))
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert not fake.inference_requests()
    assert records[0].endpoint == path.rsplit("/", 1)[1]


async def test_continuations_are_pinned_to_their_creator() -> None:
    fake = Fake(responses_answer)
    records: list[UsageRecord] = []
    app = create_app(settings(), upstream=fake.upstream)
    async for client in started(app, records):
        first = await client.post("/v1/responses", json={"model": MODEL, "input": "x" * 300})
        creator = first.headers["x-gateway-replica"]
        previous = first.json()["id"]
        for turn in range(4):
            r = await client.post("/v1/responses", json={
                "model": MODEL, "input": f"turn {turn}", "previous_response_id": previous})
            assert r.status_code == 200
            assert (r.headers["x-gateway-replica"], r.headers["x-gateway-route"]) == (
                creator, "response")
            previous = r.json()["id"]
        assert app.services is not None
        assert app.services.affinity.lookup(previous) == creator
    assert [r.endpoint for r in records] == ["responses"] * 5
    assert records[-1].route == "response"
    assert (records[0].prompt_tokens, records[0].cached_tokens) == (40, 32)


@pytest.mark.parametrize(("owner", "healthy", "status", "code"), [
    ("gone", True, 404, "previous_response_lost"),
    ("a", False, 503, "previous_response_unavailable"),
])
async def test_a_lost_creator_is_said_plainly(owner: str, healthy: bool, status: int,
                                              code: str) -> None:
    fake = Fake(responses_answer)
    records: list[UsageRecord] = []
    app = create_app(settings(), upstream=fake.upstream)
    async for client in started(app, records):
        assert app.services is not None
        app.services.affinity.remember("resp_old", owner)
        app.services.fleet.replicas["a"].healthy = healthy
        r = await client.post("/v1/responses", json={
            "model": MODEL, "input": "x", "previous_response_id": "resp_old"})
    assert r.status_code == status
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, "previous_response_id")
    assert owner in error["message"]
    assert not fake.inference_requests()


async def test_messages_usage_is_normalized() -> None:
    fake = Fake(messages_answer)
    records: list[UsageRecord] = []
    async for client in started(create_app(settings(), upstream=fake.upstream), records):
        r = await client.post("/v1/messages", json={
            "model": MODEL, "max_tokens": 4, "system": "s",
            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    rec = records[0]
    assert (rec.endpoint, rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens) == (
        "messages", 40, 32, 1)
    sent = fake.inference_requests()[0]
    assert sent.url.endswith("/v1/messages")
    assert orjson.loads(sent.body or b"") == {  # forwarded as the client wrote it
        "model": MODEL, "max_tokens": 4, "system": "s",
        "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/responses", {"model": MODEL, "instructions": f"Now: {NOW}. Be brief.",
                       "input": [{"role": "user", "content": "a " * 200},
                                 {"role": "assistant", "content": "ok"},
                                 {"role": "user", "content": "next"}]}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4,
                      "system": [{"type": "text", "text": f"Now: {NOW}. Be brief."}],
                      "messages": [{"role": "user", "content": "a " * 200},
                                   {"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": "next"}]}),
])
async def test_hygiene_scans_both_apis(path: str, body: dict[str, Any]) -> None:
    fake = Fake(responses_answer if path.endswith("responses") else messages_answer)
    records: list[UsageRecord] = []
    async for client in started(create_app(settings(), upstream=fake.upstream), records):
        r = await client.post(path, json=body)
    assert r.status_code == 200
    assert records[0].hygiene >= 1  # the timestamp in the system text
