"""AiohttpUpstream's pool against raw HTTP/1.1 servers on loopback that close keep-alive
connections on their own (idle, after every answer, late, crossing a request): a request
the server read is never sent again, not even on a reused connection, and a pooled
connection the server closed is never written to; each server counts the connections and
requests it received. Then the pool's bounds: a full pool waits a bounded time and sends
nothing, at most `connections_per_replica` connections, idle ones reaped."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from gateway.proxy.client import AiohttpUpstream, ClientLimits
from gateway.upstream.errors import UpstreamPoolBusy, UpstreamProtocolError
from tests.servers import free_port
from tests.test_proxy_client import CHUNKED, FAST, chunk

# Servers that close keep-alive connections on their own -----------------------------------

KEEP_ALIVE_OK = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n"
                 b"keep-alive: timeout=5\r\n\r\n" + b'{"ok":true}')
CLOSE_OK = (b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\nconnection: close\r\n\r\n"
            + b'{"ok":true}')


@dataclass
class Closer:
    """Answers `answered` requests per connection (only on the first `answering`
    connections), then closes: after `close_after_s` when idle, or at once when the next
    request arrives (the close crossing that request on the wire)."""

    answered: int = 1
    close_after_s: float | None = None
    answering: int = 1_000
    slow_from: int = 1_000_000  # from this connection on, the close comes `slow_s` late
    slow_s: float = 0.0
    reply: bytes = KEEP_ALIVE_OK
    connections: int = 0
    requests: int = 0


@contextlib.asynccontextmanager
async def closing_server(spec: Closer) -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        spec.connections += 1
        index = spec.connections
        answers = spec.answered if index <= spec.answering else 0
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                spec.requests += 1
                if answers == 0:
                    break  # the request arrived after the server decided to close
                answers -= 1
                writer.write(spec.reply)
                if answers == 0 and spec.close_after_s is not None:
                    late = spec.slow_s if index >= spec.slow_from else 0.0
                    await asyncio.sleep(spec.close_after_s + late)
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()  # no Connection: close was announced

    port = free_port()
    srv = await asyncio.start_server(handle, "127.0.0.1", port)
    async with srv:
        yield f"http://127.0.0.1:{port}"


async def get_ok(client: AiohttpUpstream, url: str) -> None:
    resp = await client.send("POST", url + "/v1/completions", [], b"{}", FAST)
    assert resp.status == 200 and await resp.read() == b'{"ok":true}'
    resp.release()


async def test_idle_close_is_seen_before_reuse() -> None:
    """llama.cpp: answers, then closes while advertising keep-alive. The pool must notice
    the close (EOF) and never hand that connection out."""
    spec = Closer(close_after_s=0.02)
    async with closing_server(spec) as url:
        client = AiohttpUpstream()
        try:
            for _ in range(3):
                await get_ok(client, url)
                await asyncio.sleep(0.15)  # the server's close arrives meanwhile
            assert (spec.connections, spec.requests) == (3, 3)  # none failed on use
        finally:
            await client.aclose()


async def test_a_server_closing_after_each_answer_never_gets_a_request_on_a_closed_one(
) -> None:
    """llama.cpp: closes right after each answer while advertising keep-alive. The next
    request, sent at once, must not be written on that connection (it would be lost: a
    502), nor sent twice."""
    spec = Closer(close_after_s=0.0)
    async with closing_server(spec) as url:
        client = AiohttpUpstream()
        try:
            for _ in range(20):
                await get_ok(client, url)
            assert (spec.connections, spec.requests) == (20, 20)
        finally:
            await client.aclose()


async def test_a_server_closing_after_each_answer_is_learnt_before_its_close_comes_late(
) -> None:
    """llama.cpp on a loaded machine: it closes after every answer, at first at once, then
    (from the 4th connection) 0.3 s late, so a pooled connection still looks open when the
    next request goes out and that request would be lost (a 502, not re-sent). Having
    found its pooled connections closed twice, the client closes each answer's connection
    itself: every request gets a fresh one, is read once and answered."""
    spec = Closer(close_after_s=0.0, slow_from=4, slow_s=0.3)
    async with closing_server(spec) as url:
        client = AiohttpUpstream()
        try:
            for _ in range(12):
                await get_ok(client, url)
            assert (spec.connections, spec.requests) == (12, 12)
        finally:
            await client.aclose()


async def test_a_close_crossing_a_request_is_delivered_no_answer_and_not_resent() -> None:
    """The server read the second request on the reused connection, then closed: it may
    have started it, so it is not sent again (the old client re-sent it: two requests)."""
    spec = Closer()  # answers once, closes when the second request arrives
    async with closing_server(spec) as url:
        client = AiohttpUpstream()
        try:
            await get_ok(client, url)
            with pytest.raises(UpstreamProtocolError):
                await get_ok(client, url)
            assert (spec.connections, spec.requests) == (1, 2)
        finally:
            await client.aclose()


@pytest.mark.parametrize(("method", "body"), [
    ("GET", None), ("DELETE", None), ("PUT", b"{}"), ("OPTIONS", None),
    ("POST", b"{}"),
])
async def test_no_method_is_resent_by_the_library_after_a_read_and_drop(
    method: str, body: bytes | None
) -> None:
    """aiohttp re-sends idempotent methods (GET, PUT, DELETE ...) once, on a new connection,
    when a reused one breaks after the request went out; the client turns that off: the
    second request, read then dropped on the pooled connection, reaches the server once and
    fails (the failure table decides what happens next), whatever the method."""
    spec = Closer()  # answers once per connection, closes when the second request arrives
    async with closing_server(spec) as url:
        client = AiohttpUpstream()
        try:
            for expect_ok in (True, False):
                try:
                    resp = await client.send(method, url + "/v1/responses/resp_1", [], body,
                                             FAST)
                except UpstreamProtocolError:
                    assert not expect_ok
                    continue
                assert expect_ok and resp.status == 200
                await resp.read()
                resp.release()
            assert (spec.connections, spec.requests) == (1, 2)
        finally:
            await client.aclose()


async def test_with_the_library_retry_back_on_a_delete_arrives_twice() -> None:
    """The control for the test above: the same server and client with aiohttp's retry
    turned back on sees the DELETE it read and dropped again, on a second connection (what
    the gateway did before), so the test above watches the switch that matters."""
    spec = Closer()
    async with closing_server(spec) as url:
        client = AiohttpUpstream()
        try:
            resp = await client.send("DELETE", url + "/v1/responses/resp_1", [], None, FAST)
            resp.release()
            assert client._session is not None
            client._session._retry_connection = True
            resp = await client.send("DELETE", url + "/v1/responses/resp_1", [], None, FAST)
            assert resp.status == 200  # the copy was answered, on a fresh connection
            resp.release()
            assert (spec.connections, spec.requests) == (2, 3)
        finally:
            await client.aclose()


async def test_a_request_the_server_read_is_sent_once_reused_or_fresh() -> None:
    spec = Closer(answering=1)  # only the very first request is ever answered
    async with closing_server(spec) as url:
        client = AiohttpUpstream()
        try:
            await get_ok(client, url)
            with pytest.raises(UpstreamProtocolError):
                await get_ok(client, url)  # reused connection, read then closed
            assert (spec.connections, spec.requests) == (1, 2)
            with pytest.raises(UpstreamProtocolError):
                await get_ok(client, url)  # fresh connection, read then closed
            assert (spec.connections, spec.requests) == (2, 3)  # one arrival per request
        finally:
            await client.aclose()


async def test_a_full_pool_waits_a_bounded_time_and_sends_nothing() -> None:
    got: list[bytes] = []
    release = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                got.append(await reader.readuntil(b"\r\n\r\n"))
                writer.write(CHUNKED + chunk(b"data: a\n\n"))
                await release.wait()
                writer.write(b"0\r\n\r\n")
        writer.close()

    port = free_port()
    srv = await asyncio.start_server(handle, "127.0.0.1", port)
    async with srv:
        client = AiohttpUpstream(ClientLimits(connections_per_replica=1, pool_wait_s=0.2))
        url = f"http://127.0.0.1:{port}/v1/completions"
        try:
            held = await client.send("POST", url, [], b"{}", FAST)  # the one slot, streaming
            with pytest.raises(UpstreamPoolBusy):
                await client.send("POST", url, [], b"{}", FAST)
            assert len(got) == 1  # the second request never left the gateway
            release.set()
            assert b"".join([c async for c in held.chunks()]) == b"data: a\n\n"
            held.release()
            resp = await client.send("POST", url, [], b"{}", FAST)  # the slot is free again
            resp.abort()
            assert len(got) == 2
        finally:
            await client.aclose()


async def test_connection_close_from_the_server_is_honoured() -> None:
    spec = Closer(answered=2, reply=CLOSE_OK)  # would answer again, but said close
    async with closing_server(spec) as url:
        client = AiohttpUpstream()
        try:
            await get_ok(client, url)
            await get_ok(client, url)
            assert (spec.connections, spec.requests) == (2, 2)
        finally:
            await client.aclose()


async def test_connections_per_replica_are_bounded_and_idle_ones_reaped() -> None:
    open_now = 0
    most = 0
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now, most
        open_now += 1
        most = max(most, open_now)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await asyncio.sleep(0.05)
                writer.write(KEEP_ALIVE_OK)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        open_now -= 1
        if open_now == 0:
            closed.set()
        writer.close()

    port = free_port()
    srv = await asyncio.start_server(handle, "127.0.0.1", port)
    async with srv:
        client = AiohttpUpstream(ClientLimits(connections_per_replica=2, idle_s=0.2))
        try:
            url = f"http://127.0.0.1:{port}"
            await asyncio.gather(*(get_ok(client, url) for _ in range(8)))
            assert most == 2
            await asyncio.wait_for(closed.wait(), 3.0)  # idle connections closed by us
        finally:
            await client.aclose()
