"""AiohttpUpstream against a scripted raw HTTP/1.1 server on loopback: bodies by length, chunks
and close; keep-alive reuse; limits on what comes back (head size, body size, upgrades);
every failure mapped to its UpstreamError (its failure class: gateway.upstream.failure).
Servers that close their connections on their own, and the pool's bounds:
tests/test_proxy_client_pool.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from gateway.proxy.client import AiohttpUpstream, ClientLimits
from gateway.upstream.errors import (
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.upstream.seam import Timeouts
from tests.servers import free_port

FAST = Timeouts(connect_s=2.0, read_s=2.0)
SHORT = Timeouts(connect_s=2.0, read_s=0.2)

OK_JSON = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n"
           b'{"ok":true}')
CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
           b"transfer-encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@dataclass
class Script:
    """What the server writes for each request: (bytes, pause before them) steps, then it
    keeps the connection open unless `close`."""

    steps: list[tuple[bytes, float]]
    close: bool = False
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    eof_seen: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture
async def server(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, Script]]:
    script: Script = request.param

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        script.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                script.requests.append(head + await reader.readexactly(length))
                for data, pause in script.steps:
                    await asyncio.sleep(pause)
                    writer.write(data)
                if script.close:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            script.eof_seen.set()
            writer.close()

    port = free_port()
    srv = await asyncio.start_server(handle, "127.0.0.1", port)
    async with srv:
        yield f"http://127.0.0.1:{port}", script


def scripted(*steps: bytes | tuple[bytes, float], close: bool = False) -> Script:
    return Script([s if isinstance(s, tuple) else (s, 0.0) for s in steps], close=close)


@pytest.mark.parametrize("server", [scripted(OK_JSON)], indirect=True)
async def test_json_body_and_keepalive_reuse(server: tuple[str, Script]) -> None:
    url, script = server
    client = AiohttpUpstream()
    try:
        for i in range(3):
            resp = await client.send("POST", url + "/v1/x?a=1", [("content-type", "a/b")],
                                     b"payload%d" % i, FAST)
            assert resp.status == 200
            assert (b"content-type", b"application/json") in resp.headers
            assert await resp.read() == b'{"ok":true}'
            assert resp.at_eof()
            resp.release()
        assert script.connections == 1
        first = script.requests[0]
        assert first.startswith(b"POST /v1/x?a=1 HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"content-type: a/b\r\n" in first and b"Content-Length: 8\r\n" in first
        assert first.endswith(b"\r\n\r\npayload0")
    finally:
        await client.aclose()


@pytest.mark.parametrize(("server", "expected"), [
    (scripted(CHUNKED, chunk(b"data: a\n\n"), (chunk(b"data: b\n\n") + b"0\r\n\r\n", 0.05)),
     b"data: a\n\ndata: b\n\n"),
    (scripted(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil", (b" close", 0.05),
              close=True), b"until close"),
    (scripted(b"HTTP/1.1 100 Continue\r\n\r\n" + OK_JSON), b'{"ok":true}'),
    (scripted(b"HTTP/1.1 204 No Content\r\n\r\n"), b""),
], indirect=["server"])
async def test_bodies(server: tuple[str, Script], expected: bytes) -> None:
    url, script = server
    client = AiohttpUpstream()
    try:
        resp = await client.send("GET", url + "/s", [], None, FAST)
        got = [c async for c in resp.chunks()]
        assert b"".join(got) == expected and resp.at_eof()
        resp.release()
        assert b"Content-Length" not in script.requests[0]  # GET without a body
    finally:
        await client.aclose()


@pytest.mark.parametrize(("server", "error", "method", "use"), [
    (scripted(close=True), UpstreamProtocolError, "POST", "read"),  # read, closed: delivered
    (scripted(b"garbage\r\n\r\n"), UpstreamProtocolError, "POST", "read"),
    (scripted((OK_JSON, 1.0)), UpstreamTimeout, "POST", "read"),  # no head in time
    (scripted(CHUNKED, chunk(b"data: a\n\n"), (b"", 1.0)), UpstreamTimeout, "GET", "chunks"),
    (scripted(CHUNKED, chunk(b"data: a\n\n"), close=True), UpstreamProtocolError, "GET",
     "chunks"),  # cut mid-body
    (scripted(OK_JSON[:-4], close=True), UpstreamProtocolError, "GET", "read"),
], indirect=["server"])
async def test_failures(server: tuple[str, Script], error: type[Exception], method: str,
                        use: str) -> None:
    url, _ = server
    client = AiohttpUpstream()
    try:
        with pytest.raises(error):
            resp = await client.send(method, url + "/f", [], b"{}", SHORT)
            if use == "read":
                await resp.read()
            else:
                async for _ in resp.chunks():
                    pass
    finally:
        await client.aclose()


async def test_refused() -> None:
    client = AiohttpUpstream()
    try:
        with pytest.raises(UpstreamConnectError):
            await client.send("GET", f"http://127.0.0.1:{free_port()}/health", [], None, FAST)
    finally:
        await client.aclose()


@pytest.mark.parametrize("server", [scripted(CHUNKED, chunk(b"a"), (chunk(b"b"), 0.15),
                                             (chunk(b"c"), 0.15))], indirect=True)
async def test_total_timeout_bounds_the_whole_exchange(server: tuple[str, Script]) -> None:
    url, _ = server
    client = AiohttpUpstream()
    try:
        resp = await client.send("GET", url + "/p", [], None,
                                 Timeouts(connect_s=1.0, read_s=1.0, total_s=0.2))
        with pytest.raises(UpstreamTimeout):
            await resp.read()
    finally:
        await client.aclose()


@pytest.mark.parametrize("server", [scripted(CHUNKED, chunk(b"data: a\n\n"))], indirect=True)
async def test_abort_closes_the_connection(server: tuple[str, Script]) -> None:
    url, script = server
    client = AiohttpUpstream()
    try:
        resp = await client.send("POST", url + "/s", [], b"{}", FAST)
        async for c in resp.chunks():
            assert c == b"data: a\n\n"
            break
        resp.abort()
        await asyncio.wait_for(script.eof_seen.wait(), 2.0)  # the engine sees the client go
        resp2 = await client.send("POST", url + "/s", [], b"{}", FAST)
        resp2.abort()
        assert script.connections == 2  # the aborted one was not reused
    finally:
        await client.aclose()


@pytest.mark.parametrize("server", [scripted(
    b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")], indirect=True)
async def test_head_has_no_body(server: tuple[str, Script]) -> None:
    url, _ = server
    client = AiohttpUpstream()
    try:
        resp = await client.send("HEAD", url + "/v1/models", [], None, FAST)
        assert resp.status == 200 and await resp.read() == b""
        resp.release()
    finally:
        await client.aclose()


# Limits on what comes back ------------------------------------------------------------------

ENDLESS_HEAD = b"HTTP/1.1 200 OK\r\n" + b"x-filler: " + b"a" * 60 + b"\r\n"


@pytest.mark.parametrize(("server", "method"), [
    (scripted(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
              b"connection: upgrade\r\n\r\n"), "GET"),
    (scripted(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n"), "POST"),
    (scripted(b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 20_000 + b"\r\n\r\n"), "GET"),
    (scripted(*[(ENDLESS_HEAD.replace(b"HTTP/1.1 200 OK\r\n", b"") if i else ENDLESS_HEAD,
                 0.0) for i in range(2_000)]), "POST"),
], indirect=["server"])
async def test_refused_heads_are_protocol_errors_and_do_not_poison_the_pool(
    server: tuple[str, Script], method: str
) -> None:
    url, script = server
    client = AiohttpUpstream()
    try:
        with pytest.raises(UpstreamProtocolError):
            await client.send(method, url + "/x", [], b"{}" if method == "POST" else None, FAST)
        script.steps = [(OK_JSON, 0.0)]  # the next request gets its own answer
        resp = await client.send("GET", url + "/y", [], None, FAST)
        assert await resp.read() == b'{"ok":true}'
        resp.release()
        assert script.connections == 2  # the refused connection was closed, not reused
    finally:
        await client.aclose()


@pytest.mark.parametrize("server", [scripted(
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5000\r\n\r\n",
    *[(b"x" * 1000, 0.0)] * 5)], indirect=True)
async def test_a_body_over_the_limit_is_refused(server: tuple[str, Script]) -> None:
    url, _ = server
    client = AiohttpUpstream(ClientLimits(max_body_bytes=4096))
    try:
        resp = await client.send("POST", url + "/v1/chat/completions", [], b"{}", FAST)
        with pytest.raises(UpstreamProtocolError, match="larger than 4096"):
            await resp.read()
        resp.abort()
    finally:
        await client.aclose()


@pytest.mark.parametrize("server", [scripted(
    b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")], indirect=True)
async def test_a_head_answer_does_not_poison_the_next_request(server: tuple[str, Script]) -> None:
    """A HEAD answer announces a length it never sends; reading it as a body would make the
    next request on that connection receive the wrong bytes or hang."""
    url, script = server
    client = AiohttpUpstream()
    try:
        resp = await client.send("HEAD", url + "/v1/models", [], None, FAST)
        assert resp.status == 200 and await resp.read() == b""
        resp.release()
        script.steps = [(OK_JSON, 0.0)]
        resp = await client.send("GET", url + "/v1/models", [], None, FAST)
        assert await resp.read() == b'{"ok":true}'
        resp.release()
    finally:
        await client.aclose()
