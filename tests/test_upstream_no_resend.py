"""A forwarded `GET` or `DELETE` on a stored response (`/v1/responses/{id}`) reaches the
engine once, through the gateway app under uvicorn with its real aiohttp upstream: the raw
backend answers the first such call on a connection, keeping it alive, then reads the next
one on that pooled connection and drops it. The client is told 502 (delivered, no answer:
gateway/upstream/failure.py) and the backend counts one arrival of it, not two (aiohttp's
own re-send of idempotent methods, on by default, sent it again on a fresh connection: the
backend counted it twice and the client got the copy's answer)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.recording_replica import MODELS, response
from tests.test_failure_loopback import serve

STORED = b'{"id":"resp_1","object":"response","deleted":true}'


class DroppingBackend:
    """Probes answered; on each connection, the first call on a stored response answered
    (keep-alive), the next read whole and the connection dropped. `calls` counts arrivals
    of those calls by method."""

    def __init__(self, answer_first: bool = True) -> None:
        self.answer_first = answer_first  # False: every call read and dropped
        self.calls: Counter[str] = Counter()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                if not path.startswith(b"/v1/responses/"):
                    body = MODELS if path == b"/v1/models" else b"{}"
                    writer.write(response("200 OK", body))
                    continue
                self.calls[method.decode()] += 1
                if answered or not self.answer_first:
                    if length := _length(head):
                        await reader.readexactly(length)
                    break  # read whole, then the connection goes
                answered = True
                writer.write(response("200 OK", STORED))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


@contextlib.asynccontextmanager
async def dropping_backend(answer_first: bool = True) -> AsyncIterator[DroppingBackend]:
    backend = DroppingBackend(answer_first)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.stop()


@pytest.mark.parametrize("method", ["DELETE", "GET"])
async def test_a_forwarded_call_read_and_dropped_reaches_the_engine_once(method: str) -> None:
    async with dropping_backend() as backend, serve(
        {"r1": f"http://127.0.0.1:{backend.port}"}
    ) as gw, httpx.AsyncClient(timeout=10) as client:
        first = await client.request(method, gw.url + "/v1/responses/resp_1")
        assert first.status_code == 200 and first.content == STORED
        again = await client.request(method, gw.url + "/v1/responses/resp_1")  # pooled
        assert again.status_code == 502, again.text
        assert again.json()["error"]["code"] == "upstream_protocol_error"
        assert backend.calls == {method: 2}  # each call arrived once


@pytest.mark.parametrize("method", ["DELETE", "GET", "PUT", "POST"])
async def test_a_call_dropped_on_a_fresh_connection_reaches_the_engine_once(
        method: str) -> None:
    """The first call to a replica goes out on a new connection, which the backend reads
    and drops: aiohttp's re-send (on for idempotent methods whether the connection was
    pooled or new) would have sent it again on another new one."""
    async with dropping_backend(answer_first=False) as backend, serve(
        {"r1": f"http://127.0.0.1:{backend.port}"}
    ) as gw, httpx.AsyncClient(timeout=10) as client:
        body = b'{"x": 1}' if method in ("PUT", "POST") else None
        got = await client.request(method, gw.url + "/v1/responses/resp_1", content=body,
                                   headers={"content-type": "application/json"})
        assert got.status_code == 502, got.text
        assert backend.calls == {method: 1}
