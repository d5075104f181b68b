"""The seam between the gateway and its replicas: one `send()` that returns a response whose
body can be read whole or relayed chunk by chunk, and closed early.

`AiohttpUpstream` is the production transport: one pooled `aiohttp.ClientSession` per app
(keep-alive, unlimited pool, TCP_NODELAY which aiohttp sets on every connection), no
automatic decompression and no Accept-Encoding, so bytes are relayed exactly as the engine
wrote them. aiohttp was chosen by measurement (see bench/results/proxy.md): its client
costs about a tenth of httpx's per relayed request.

Every aiohttp exception is translated here, once, into `gateway.errors.Upstream*`:
failures before the response head are `UpstreamConnectError` (nothing reached the client,
the caller may retry on another replica) or `UpstreamTimeout`; failures while reading the
body are `UpstreamProtocolError` or `UpstreamTimeout`. Tests inject any object with the same
shape (`gateway.mock_upstream.MockUpstream`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from gateway.errors import UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout

RawHeaders = Sequence[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float
    read_s: float  # longest wait for the next bytes (or total, for probes: see `total`)
    total_s: float | None = None


class UpstreamResponse(Protocol):
    status: int
    headers: RawHeaders  # raw (name, value) pairs as received

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def release(self) -> None:
        """Body fully consumed: give the connection back to the pool."""

    def abort(self) -> None:
        """Stop now: close the connection so the engine sees the client go and frees KV."""


class Upstream(Protocol):
    async def send(
        self, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes | None,
        timeouts: Timeouts,
    ) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...


class _AiohttpResponse:
    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers: RawHeaders = resp.raw_headers

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout("read timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamProtocolError(str(exc) or type(exc).__name__) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        """Whatever has arrived at each step (readany coalesces the buffered reads)."""
        content = self._resp.content
        try:
            while chunk := await content.readany():
                yield chunk
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout("read timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamProtocolError(str(exc) or type(exc).__name__) from exc

    def at_eof(self) -> bool:
        """The body has ended and every byte was read: `chunks()` ends without waiting."""
        return self._resp.content.at_eof()

    def release(self) -> None:
        self._resp.release()

    def abort(self) -> None:
        self._resp.close()


class AiohttpUpstream:
    """Build inside a running event loop (the app's lifespan)."""

    def __init__(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=30.0, ttl_dns_cache=300, enable_cleanup_closed=False
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self._timeouts: dict[Timeouts, aiohttp.ClientTimeout] = {}

    def _timeout(self, t: Timeouts) -> aiohttp.ClientTimeout:
        cached = self._timeouts.get(t)
        if cached is None:
            cached = aiohttp.ClientTimeout(total=t.total_s, connect=t.connect_s, sock_read=t.read_s)
            self._timeouts[t] = cached
        return cached

    async def send(
        self, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes | None,
        timeouts: Timeouts,
    ) -> UpstreamResponse:
        try:
            resp = await self._session.request(
                method, url, data=body, headers=list(headers), timeout=self._timeout(timeouts),
                allow_redirects=False,
            )
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout("timed out waiting for the response head") from exc
        except aiohttp.ClientResponseError as exc:  # malformed head
            raise UpstreamProtocolError(str(exc)) from exc
        except (aiohttp.ClientError, OSError) as exc:
            # refused, reset, or a pooled connection the server had closed: the request
            # never produced an answer, so another replica may take it
            raise UpstreamConnectError(str(exc) or type(exc).__name__) from exc
        return _AiohttpResponse(resp)

    async def aclose(self) -> None:
        await self._session.close()
        # let the connector's transports finish closing before the loop goes away
        await asyncio.sleep(0)
