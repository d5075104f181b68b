"""The edges of both apps' route tables (Starlette's): unknown paths and wrong methods in the
error shape each side owes (OpenAI's on the gateway, FastAPI's `detail` on the simulator),
HEAD on the gateway's own GET routes, and the gateway's inference path reaching the raw-ASGI
proxy without passing through Starlette."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.asgi import Receive, Scope, Send
from gateway.proxy.app import create_app
from gateway.usage.record import UsageRecord
from tests.proxy_fakes import COMPLETION, Fake, chat, settings, started
from tests.servers import sim
from tests.sim_http import FAST


@pytest.mark.parametrize(("method", "path", "status", "code", "allow"), [
    ("GET", "/nowhere", 404, "not_found", None),
    ("POST", "/", 404, "not_found", None),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed", "POST"),
    ("PUT", "/v1/messages", 405, "method_not_allowed", "POST"),
    ("POST", "/health", 405, "method_not_allowed", "GET, HEAD"),
    ("DELETE", "/stats", 405, "method_not_allowed", "GET, HEAD"),
    ("POST", "/v1/models", 405, "method_not_allowed", "GET, HEAD"),
    ("POST", "/v1/models/m", 405, "method_not_allowed", "GET, HEAD"),
    ("GET", "/v1/models/no-such-model", 404, "model_not_found", None),
])
async def test_gateway_errors_in_openai_shape(
    method: str, path: str, status: int, code: str, allow: str | None,
) -> None:
    fake = Fake()
    async for client in started(create_app(settings(), upstream=fake.upstream), []):
        r = await client.request(method, path)
        assert r.status_code == status
        assert r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == code
        assert r.headers.get("allow") == allow
    assert fake.inference_requests() == []  # nothing of these reached a replica


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/stats", "/v1/models"])
async def test_gateway_head_on_own_routes(path: str) -> None:
    async for client in started(create_app(settings(), upstream=Fake().upstream), []):
        got, head = await client.get(path), await client.head(path)
        assert head.status_code == got.status_code
        assert head.headers["content-type"] == got.headers["content-type"]


async def test_gateway_inference_path_bypasses_starlette() -> None:
    """The hot path pays nothing for the framework: with the Starlette app replaced by one
    that fails, inference still answers and the own routes do not."""
    fake = Fake()
    app = create_app(settings(), upstream=fake.upstream)
    records: list[UsageRecord] = []
    async for client in started(app, records):
        async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
            raise AssertionError(f"Starlette saw {scope['path']}")

        app._own = refuse  # type: ignore[assignment]
        r = await client.post("/v1/chat/completions", content=orjson.dumps(chat()))
        assert (r.status_code, r.content) == (200, COMPLETION)
        with pytest.raises(AssertionError, match="Starlette saw /health"):
            await client.get("/health")
    assert len(fake.inference_requests()) == 1
    assert [rec.status for rec in records] == [200]


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    with sim(1, FAST) as urls:
        yield urls[0]


@pytest.mark.parametrize(("method", "path", "status", "detail", "allow"), [
    ("GET", "/nowhere", 404, "Not Found", None),
    ("GET", "/v1/chat/completions", 405, "Method Not Allowed", "POST"),
    ("GET", "/v1/messages", 405, "Method Not Allowed", "POST"),
    ("POST", "/v1/models", 405, "Method Not Allowed", {"GET", "HEAD"}),
    ("GET", "/tokenize", 405, "Method Not Allowed", "POST"),
    ("DELETE", "/ping", 405, "Method Not Allowed", {"GET", "HEAD", "POST"}),
])
def test_simulator_errors_in_fastapi_shape(
    replica: str, method: str, path: str, status: int, detail: str,
    allow: str | set[str] | None,
) -> None:
    r = httpx.request(method, replica + path, timeout=30)
    assert r.status_code == status
    assert r.json() == {"detail": detail}
    got = r.headers.get("allow")
    if isinstance(allow, set):
        assert got is not None and set(got.split(", ")) == allow
    else:
        assert got == allow


def test_simulator_stored_response_unknown_id(replica: str) -> None:
    """`GET /v1/responses/{id}` through the route table: an id it does not hold is a 404 in
    vLLM's error shape (not the router's `detail`)."""
    r = httpx.get(replica + "/v1/responses/resp_nope", timeout=30)
    assert r.status_code == 404
    assert "error" in r.json()


async def test_gateway_startup_failure_stops_the_server() -> None:
    """Starlette's lifespan owns start-up: a failure there reaches uvicorn, which does not
    start serving (`gateway serve` then exits non-zero)."""
    import uvicorn

    app = create_app(settings(), upstream=Fake().upstream)

    async def broken() -> None:
        raise RuntimeError("no fleet today")

    app.startup = broken  # type: ignore[method-assign]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on",
                                           log_config=None))
    with pytest.raises(SystemExit) as exited:
        async with asyncio.timeout(30):
            await server.serve()
    assert exited.value.code not in (0, None)
    assert not server.started
    assert app.services is None
