"""Shared pieces of the in-process gateway app tests: two fake replicas (a, b) behind one
MockUpstream, canned completion/SSE replies, settings for them, and a client that runs the app
through httpx.ASGITransport while spying on the usage records it writes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson

from gateway.proxy.app import GatewayApp
from gateway.proxy.errors import UpstreamConnectError
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from gateway.usage.record import UsageRecord
from tests.upstream_double import MockReply, MockRequest, MockUpstream

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



async def started(app: GatewayApp, records: list[UsageRecord]) -> AsyncIterator[httpx.AsyncClient]:
    async with app.running():
        assert app.services is not None
        recorder = app.services.recorder
        original = recorder.record

        def spy(rec: UsageRecord, departed: bool = False) -> None:
            records.append(rec)
            original(rec, departed)

        recorder.record = spy  # type: ignore[method-assign]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 50}], **extra}

