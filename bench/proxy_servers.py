"""The servers `bench_proxy.py` measures beside the gateway, each run in its own process:
the instant backend (a raw-asyncio HTTP/1.1 server answering every POST at once with a
canned chat completion, or 64 SSE events, the usage chunk and `[DONE]`), and the two bare
relays that are the gateway's yardsticks (aiohttp's server and client; the same relay as an
ASGI app on uvicorn)."""

from __future__ import annotations

import asyncio
import socket
import zlib
from typing import Any

import aiohttp
import orjson

USAGE = {"prompt_tokens": 512, "total_tokens": 528, "completion_tokens": 16,
         "prompt_tokens_details": {"cached_tokens": 384}}
COMPLETION = orjson.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 16},
                 "finish_reason": "stop"}],
    "usage": USAGE,
})
EVENT = (b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,'
         b'"model":"bench","choices":[{"index":0,"delta":{"content":"tok "},'
         b'"logprobs":null,"finish_reason":null}]}\n\n')
STREAM = [EVENT] * 64 + [
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[],"usage":' + orjson.dumps(USAGE) + b"}\n\n",
    b"data: [DONE]\n\n",
]
MODELS = orjson.dumps({"object": "list", "data": [{"id": "bench", "object": "model"}]})


def sized_completion(body: bytes) -> bytes:
    """A completion whose usage follows the prompt (about 4 bytes a token, cached tokens
    not reported) and whose text differs per prompt (a client repeats it in its next turn):
    a backend answering 512 prompt tokens with 384 cached for a 256 KiB prompt would make
    the gateway's feedback distrust its index on every request, and one answer for every
    conversation would make them look like one, which no real engine does."""
    tokens = len(body) // 4
    return orjson.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
        "choices": [{"index": 0, "message": {
            "role": "assistant", "content": f"ok, done ({zlib.crc32(body[-256:]):08x}) " * 4},
            "finish_reason": "stop"}],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens + 16, "completion_tokens": 16},
    })



# -- the instant backend ----------------------------------------------------------------------

class Backend(asyncio.Protocol):
    sized = False  # usage from the prompt's size (sized_completion), not the canned one

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.t = transport
        self.buf = b""
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.buf.startswith(b"PRI * HTTP/2.0"):
            # sglang-router and vllm-router try HTTP/2 prior knowledge (gRPC detection)
            # first; closing makes them fall back to HTTP/1.1
            self.t.close()
            return
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            if len(self.buf) < head_end + 4 + length:
                return
            body = self.buf[head_end + 4: head_end + 4 + length]
            self.buf = self.buf[head_end + 4 + length:]
            self.answer(head.split(" ", 2)[1], body)

    def _send(self, ctype: bytes, payload: bytes) -> None:
        self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
                     + str(len(payload)).encode() + b"\r\n\r\n" + payload)

    def answer(self, path: str, body: bytes) -> None:
        if path == "/v1/models":
            self._send(b"application/json", MODELS)
        elif path in ("/health", "/metrics"):
            self._send(b"text/plain", b"")
        elif b'"stream":true' in body:
            self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for event in STREAM:
                self.t.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.t.write(b"0\r\n\r\n")
        else:
            self._send(b"application/json", sized_completion(body) if self.sized else COMPLETION)


class SizedBackend(Backend):
    sized = True


async def serve_backend(port: int, sized: bool = False) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(SizedBackend if sized else Backend, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


# -- the bare relay: what any aiohttp proxy costs, the yardstick for the gateway --------------

async def serve_relay(port: int, backends: list[str]) -> None:
    """aiohttp's server and client and nothing else: read the body, send it to the next
    backend (round robin), relay the answer (streamed chunk by chunk, or whole)."""
    from aiohttp import web

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=256), auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"))
    turn = 0

    async def relay(request: web.Request) -> web.StreamResponse:
        nonlocal turn
        body = await request.read()
        turn += 1
        backend = backends[turn % len(backends)]
        async with session.post(backend + request.path, data=body,
                                headers={"content-type": "application/json"}) as up:
            ctype = up.headers.get("content-type", "")
            if not ctype.startswith("text/event-stream"):
                return web.Response(body=await up.read(), status=up.status,
                                    content_type="application/json")
            out = web.StreamResponse(status=up.status, headers={"content-type": ctype})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/ready", ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


async def serve_asgi_relay(port: int, backends: list[str]) -> None:
    """The same relay as a bare ASGI app on uvicorn (httptools, uvloop, no WebSocket, no
    access log: how `gateway serve` runs): what the gateway's front costs before any of
    the gateway's own work."""
    import uvicorn

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=256), auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"))
    turn = 0

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal turn
        if scope["type"] != "http":
            return
        if scope["path"] == "/ready":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        parts = []
        while True:
            msg = await receive()
            parts.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        turn += 1
        backend = backends[turn % len(backends)]
        async with session.post(backend + scope["path"], data=b"".join(parts),
                                headers={"content-type": "application/json"}) as up:
            ctype = up.headers.get("content-type", "").encode()
            await send({"type": "http.response.start", "status": up.status,
                        "headers": [(b"content-type", ctype)]})
            if not ctype.startswith(b"text/event-stream"):
                await send({"type": "http.response.body", "body": await up.read()})
                return
            async for chunk in up.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    config = uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools", ws="none",
                            loop="none", lifespan="off", access_log=False, log_config=None)
    await uvicorn.Server(config).serve()


async def serve_starlette_relay(port: int, backends: list[str]) -> None:
    """The same relay written the usual way on Starlette (a route, `Request.body()`, a
    `Response` or a `StreamingResponse` of the upstream's chunks) on uvicorn as above: the
    "bare starlette + aiohttp relay" a Python team would write first, the yardstick of the
    proxy-CPU issue's table."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=256), auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"))
    turn = 0

    async def relay(request: Request) -> Response:
        nonlocal turn
        body = await request.body()
        turn += 1
        backend = backends[turn % len(backends)]
        up = await session.post(backend + request.url.path, data=body,
                                headers={"content-type": "application/json"})
        ctype = up.headers.get("content-type", "")
        if not ctype.startswith("text/event-stream"):
            try:
                return Response(await up.read(), status_code=up.status, media_type=ctype)
            finally:
                up.release()

        async def chunks() -> Any:
            try:
                async for chunk in up.content.iter_any():
                    yield chunk
            finally:
                up.release()

        return StreamingResponse(chunks(), status_code=up.status, media_type=ctype)

    async def ready(request: Request) -> Response:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/chat/completions", relay, methods=["POST"]),
                            Route("/ready", ready)])
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools", ws="none",
                            loop="none", lifespan="off", access_log=False, log_config=None)
    await uvicorn.Server(config).serve()
