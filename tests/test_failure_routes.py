"""Calls that must reach one particular replica, or a replica at all, in process: a stored
response's GET/DELETE/cancel go to the replica that created it; vLLM's own endpoints outside
/v1/ (/tokenize, /detokenize, ...) are forwarded by the body's model instead of a 404."""

from __future__ import annotations

import orjson
import pytest

from gateway.proxy.app import create_app
from gateway.proxy.pinning import stored_response
from gateway.usage.record import UsageRecord
from tests.proxy_fakes import JSON_H, MODEL, Fake, settings, started
from tests.upstream_double import MockReply, MockRequest


@pytest.mark.parametrize(("path", "method", "rid"), [
    ("/v1/responses/resp_1", "GET", "resp_1"),
    ("/v1/responses/resp_1", "DELETE", "resp_1"),
    ("/v1/responses/resp_1/cancel", "POST", "resp_1"),
    ("/v1/responses/resp_1/cancel", "GET", None),
    ("/v1/responses/resp_1", "POST", None),
    ("/v1/responses", "POST", None),
    ("/v1/responses/", "GET", None),
    ("/v1/responses/resp_1/input_items/x", "GET", None),
    ("/v1/chat/completions", "POST", None),
])
def test_stored_response(path: str, method: str, rid: str | None) -> None:
    assert stored_response(path, method) == rid


def answer(replica: str, req: MockRequest) -> MockReply:
    if req.url.endswith("/v1/responses") and req.method == "POST":
        body = {"id": f"resp_{replica}", "object": "response", "status": "completed",
                "output": [], "usage": {"input_tokens": 5, "output_tokens": 1,
                                        "total_tokens": 6}}
        return MockReply(200, JSON_H, [orjson.dumps(body)])
    return MockReply(200, JSON_H, [orjson.dumps({"replica": replica, "url": req.url})])


async def test_a_stored_response_is_read_and_cancelled_where_it_was_created() -> None:
    records: list[UsageRecord] = []
    fake = Fake(answer)
    app = create_app(settings(), upstream=fake.upstream)
    async for client in started(app, records):
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "hi"})
        creator = r.headers["x-gateway-replica"]
        rid = r.json()["id"]
        for _ in range(4):
            for method, path in (("GET", f"/v1/responses/{rid}"),
                                 ("POST", f"/v1/responses/{rid}/cancel"),
                                 ("DELETE", f"/v1/responses/{rid}")):
                got = await client.request(method, path)
                assert got.status_code == 200 and got.json()["replica"] == creator
                assert got.headers["x-gateway-route"] == "response"
        assert app.services is not None
        app.services.fleet.replicas[creator].healthy = False
        got = await client.get(f"/v1/responses/{rid}")
        assert got.status_code == 503 and got.json()["error"]["param"] == "response_id"


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/pooling", "/score",
                                  "/rerank", "/classify", "/v1/chat/completions/render",
                                  "/v1/completions/render", "/v1/embeddings"])
async def test_vllm_endpoints_are_forwarded_by_model(path: str) -> None:
    fake = Fake(answer, models={"a": ["other"], "b": [MODEL]})
    app = create_app(settings(), upstream=fake.upstream)
    async for client in started(app, []):
        r = await client.post(path, json={"model": MODEL, "prompt": "hello"})
        assert r.status_code == 200, r.text
        assert r.json() == {"replica": "b", "url": "http://b.test" + path}
