"""The gateway app in process: httpx.ASGITransport against `create_app` with a MockUpstream
standing in for the replicas (routes, headers, body handling, errors, retries, records)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.app import GatewayApp, create_app
from gateway.errors import UpstreamConnectError, UpstreamTimeout
from gateway.mock_upstream import MockReply, MockRequest, MockUpstream
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from gateway.usage.record import UsageRecord

MODEL = "m1"
JSON_H = [("content-type", "application/json")]
SSE_H = [("content-type", "text/event-stream; charset=utf-8"), ("x-sim-timing", "q=1")]

COMPLETION = orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 40, "total_tokens": 42, "completion_tokens": 2,
              "prompt_tokens_details": {"cached_tokens": 32}},
})
EVENTS = [
    b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b": sim-timing {}\n\n",
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}'
    b"\n\n",
]
USAGE_EVENT = (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":40,"total_tokens":42,'
               b'"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":16}}}\n\n')
DONE = b"data: [DONE]\n\n"

Behavior = Callable[[str, MockRequest], MockReply]


def ok_json(replica: str, req: MockRequest) -> MockReply:
    return MockReply(200, JSON_H, [COMPLETION])


def ok_stream(replica: str, req: MockRequest) -> MockReply:
    body = orjson.loads(req.body or b"{}")
    with_usage = (body.get("stream_options") or {}).get("include_usage")
    return MockReply(200, SSE_H, [*EVENTS, *([USAGE_EVENT] if with_usage else []), DONE])


class Fake:
    """Two replicas (a, b) behind one MockUpstream; `behave` decides the inference answers."""

    def __init__(self, behave: Behavior = ok_json, models: dict[str, list[str]] | None = None,
                 down: tuple[str, ...] = ()) -> None:
        self.behave = behave
        self.models = models or {"a": [MODEL], "b": [MODEL]}
        self.down = set(down)
        self.upstream = MockUpstream(self.handle)

    async def handle(self, req: MockRequest) -> MockReply:
        replica = req.url.split("//")[1].split(".")[0]
        path = req.url.split(".test", 1)[1]
        if replica in self.down:
            raise UpstreamConnectError("connection refused")
        if path == "/health":
            return MockReply(200, JSON_H, [b""])
        if path == "/v1/models":
            cards = [{"id": m, "object": "model", "owned_by": "vllm"}
                     for m in self.models.get(replica, [])]
            return MockReply(200, JSON_H, [orjson.dumps({"object": "list", "data": cards})])
        if path == "/metrics":
            return MockReply(200, [("content-type", "text/plain")], [b""])
        return self.behave(replica, req)

    def inference_requests(self) -> list[MockRequest]:
        return [r for r in self.upstream.requests if r.method == "POST"]


def settings(**server: Any) -> Settings:
    replicas = tuple(ReplicaSettings(name=n, url=f"http://{n}.test") for n in ("a", "b"))
    # no start-up details probe: its completions would count as inference requests here
    return Settings(replicas=replicas, server=ServerSettings(**server),
                    usage=UsageConfig(startup_probe=False))


@pytest.fixture
def records() -> list[UsageRecord]:
    return []


async def started(app: GatewayApp, records: list[UsageRecord]) -> AsyncIterator[httpx.AsyncClient]:
    async with app.running():
        assert app.services is not None
        recorder = app.services.recorder
        original = recorder.record

        def spy(rec: UsageRecord) -> None:
            records.append(rec)
            original(rec)

        recorder.record = spy  # type: ignore[method-assign]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 50}], **extra}


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
    assert sent.headers["x-request-id"] == "rid-1"
    assert "authorization" not in sent.headers
    (rec,) = records
    assert (rec.request_id, rec.status, rec.model, rec.session, rec.stream) == (
        "rid-1", 200, MODEL, "alice", False)
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

        def spy(*args: Any, _original: Callable[..., None] = router.completed) -> None:
            seen.append(args)
            _original(*args)

        router.completed = spy  # type: ignore[method-assign]
        r = await client.post("/v1/chat/completions", json=chat(stream=stream))
        assert r.status_code == 200
    ((_plan, _replica, prompt, cached, ok, _now, text, completion),) = seen
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
    from gateway.session import resolve_session

    assert resolve_session(b"s-h", {"prompt_cache_key": "k", "user": "u"}) == "s-h"
    assert resolve_session(None, {"prompt_cache_key": "k", "user": "u"}) == "k"
    assert resolve_session(b"", {"prompt_cache_key": "", "user": "u"}) == "u"
    assert resolve_session(None, {"user": 3}) is None


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


async def test_replica_key_goes_upstream() -> None:
    fake = Fake()
    replicas = (ReplicaSettings(name="a", url="http://a.test", api_key="up-secret"),)
    app = create_app(dataclasses.replace(settings(), replicas=replicas), upstream=fake.upstream)
    async for client in started(app, []):
        r = await client.post("/v1/chat/completions", json=chat(),
                              headers={"authorization": "Bearer client"})
        assert r.status_code == 200
    assert fake.inference_requests()[0].headers["authorization"] == "Bearer up-secret"


@pytest.mark.parametrize("failure", ["refuse", "500"])
async def test_retry_on_next_replica_before_first_byte(
    records: list[UsageRecord], failure: str
) -> None:
    tried: list[str] = []

    def first_fails(replica: str, req: MockRequest) -> MockReply:
        tried.append(replica)
        if len(tried) == 1:
            if failure == "refuse":
                raise UpstreamConnectError("refused")
            return MockReply(500, JSON_H, [b'{"error":{"message":"boom","code":500}}'])
        return MockReply(200, JSON_H, [COMPLETION])

    app = create_app(settings(), upstream=Fake(first_fails).upstream)
    async for client in started(app, records):
        r = await client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200
        assert r.headers["x-gateway-replica"] == tried[1] != tried[0]
        assert app.services is not None
        assert all(x.in_flight == 0 for x in app.services.fleet.replicas.values())
        healthy = {x.name for x in app.services.fleet.healthy()}
    assert healthy == ({"a", "b"} - {tried[0]} if failure == "refuse" else {"a", "b"})
    assert len(records) == 1 and records[0].replica == tried[1]


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
    original = fake.upstream.responses

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
    assert original[-1].aborted


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
        assert isinstance(stats, dict)
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
    with caplog.at_level(logging.DEBUG, logger="gateway.proxy"):
        async for client in started(app, records):
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    logged = [r for r in caplog.records if r.getMessage() == "hygiene finding"]
    assert logged and {r.__dict__["severity"] for r in logged} == {severity}
    assert {r.levelno for r in logged} == {level}
