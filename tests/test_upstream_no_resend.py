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

    def __init__(self) -> None:
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
                if answered:
                    break  # read whole (no body), then the connection goes
                answered = True
                writer.write(response("200 OK", STORED))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def dropping_backend() -> AsyncIterator[DroppingBackend]:
    backend = DroppingBackend()
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
