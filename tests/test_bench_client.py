"""The bench client against a scripted OpenAI-style server on loopback: SSE parsing, usage,
simulator timing (comment and header), gateway headers, errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.bench.client import post

TIMING = {"arrival_s": 1.5, "queue_ms": 2.0, "ttft_ms": 40.0, "e2e_ms": 90.0,
          "prompt_tokens": 50, "cached_tokens": 32}
USAGE = {"prompt_tokens": 50, "completion_tokens": 3, "total_tokens": 53,
         "prompt_tokens_details": {"cached_tokens": 32}}


def sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body.get("model") == "bad":
        return web.json_response({"error": {"message": "no such model", "type": "x",
                                            "param": None, "code": 404}}, status=404)
    headers = {"x-gateway-replica": "r1", "x-gateway-route": "prefix", "x-request-id": "abc"}
    if not body.get("stream"):
        return web.json_response(
            {"choices": [{"message": {"role": "assistant", "content": "hello there"}}],
             "usage": USAGE},
            headers={**headers, "x-sim-timing": orjson.dumps(TIMING).decode()},
        )
    resp = web.StreamResponse(headers={**headers, "content-type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
    # split a chunk across writes to exercise line buffering
    first = sse({"choices": [{"index": 0, "delta": {"content": "hel"}}]})
    await resp.write(first[:10])
    await resp.write(first[10:])
    await resp.write(sse({"choices": [{"index": 0, "delta": {"content": "lo"}}]}))
    await resp.write(sse({"choices": [], "usage": USAGE}))
    await resp.write(b": sim-timing " + orjson.dumps(TIMING) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("stream", "text"), [(True, "hello"), (False, "hello there")])
async def test_post_reads_text_usage_timing_headers(server: str, stream: bool, text: str) -> None:
    async with aiohttp.ClientSession() as http:
        ex = await post(http, server, {"model": "m", "messages": [], "stream": stream})
    assert ex.error is None and ex.status == 200
    assert ex.text == text
    assert (ex.prompt_tokens, ex.cached_tokens, ex.completion_tokens) == (50, 32, 3)
    assert ex.sim_timing == TIMING
    assert ex.headers["x-gateway-replica"] == "r1"
    assert ex.wall_ttft_ms is not None and ex.wall_e2e_ms >= ex.wall_ttft_ms


async def test_post_reports_http_errors(server: str) -> None:
    async with aiohttp.ClientSession() as http:
        ex = await post(http, server, {"model": "bad", "messages": [], "stream": True})
    assert ex.status == 404 and ex.error is not None and "no such model" in ex.error


async def test_post_reports_connection_errors() -> None:
    from tests.servers import free_port

    async with aiohttp.ClientSession() as http:
        ex = await post(http, f"http://127.0.0.1:{free_port()}/v1/chat/completions",
                        {"model": "m", "messages": [], "stream": True}, timeout_s=5)
    assert ex.status == 0 and ex.error is not None


async def test_runner_feeds_real_replies_back_and_records_every_request(server: str) -> None:
    import dataclasses

    from gateway.bench.presets import PRESETS
    from gateway.bench.runner import RunOptions, run_workload
    from gateway.bench.workload import build_workload

    wl = build_workload(dataclasses.replace(PRESETS["tiny"].workload, sessions=3))
    base = server.removesuffix("/v1/chat/completions")
    result = await run_workload(
        wl, RunOptions(base_url=base, model="m", concurrency=2, time_scale=0.001,
                       max_wall_s=30, progress=False),
    )
    assert len(result.records) == wl.request_count() and result.unfinished_sessions == 0
    assert all(r.error is None and r.timing == "sim" and r.replica == "r1"
               for r in result.records)
    for rec, body in zip(result.records, result.bodies, strict=True):
        replies = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
        assert replies == ["hello"] * rec.turn  # the endpoint's answers, one per earlier turn


async def test_runner_stops_a_session_whose_request_fails(server: str) -> None:
    import dataclasses

    from gateway.bench.presets import PRESETS
    from gateway.bench.runner import RunOptions, run_workload
    from gateway.bench.workload import build_workload

    wl = build_workload(dataclasses.replace(PRESETS["tiny"].workload, sessions=2, fanout=1))
    base = server.removesuffix("/v1/chat/completions")
    result = await run_workload(
        wl, RunOptions(base_url=base, model="bad", time_scale=0.001, max_wall_s=30,
                       progress=False),
    )
    assert len(result.records) == 2 and result.unfinished_sessions == 2
