"""The production `Upstream` (gateway.proxy.upstream): aiohttp's client, one session for every
replica, with the rules the relay path needs.

- Pool: keep-alive connections per replica (aiohttp's connector keys them by host and port),
  at most `connections_per_replica` of them; a request over that waits for a free one
  (bounded by the read timeout). Connections idle longer than `idle_s` are closed by the
  connector's own reaper; keep `idle_s` below the replicas' keep-alive timeout (uvicorn, so
  vLLM: 5 s) so the gateway, not the engine, closes idle connections.
- Stale connections: a server may close an idle keep-alive connection just as the next
  request is written on it. aiohttp retries that only for idempotent methods; inference is a
  POST. A request that fails on a *reused* connection before any response byte
  (ServerDisconnectedError / ClientOSError; the connector marks reuse in the request's
  context, `_ReuseConnector`) is sent once more, on a fresh connection to the same replica:
  the engine never saw it, and retrying elsewhere would lose the prefix cache.
- Bytes as the engine wrote them: no Accept-Encoding or User-Agent is added and nothing is
  decompressed (`auto_decompress=False`); a streamed body is handed on as each read
  returns it (`iter_any`), never collected. aiohttp sets TCP_NODELAY on every connection.
- Limits on what comes back: a response head's lines, fields and count are bounded by
  aiohttp's parser (`max_line_size`, `max_field_size`, `max_headers`), a body read whole
  by `max_body_bytes`; an informational or upgrade answer (1xx, e.g. `101 Switching
  Protocols`) is refused as a protocol error and its connection closed.
- Errors: aiohttp's exceptions are translated here, once, into `gateway.proxy.errors`:
  nothing reached the engine -> UpstreamConnectError (the caller may try another replica),
  no answer in time -> UpstreamTimeout, anything malformed or cut -> UpstreamProtocolError.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.connector import Connection

from gateway.proxy.errors import UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from gateway.proxy.upstream import RawHeaders, Timeouts

_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientLimits:
    connections_per_replica: int = 256
    idle_s: float = 4.0
    max_body_bytes: int = 64 * 1024 * 1024  # a non-streamed answer read whole
    max_line_size: int = 8190  # status line and each header line
    max_field_size: int = 8190
    max_headers: int = 128


class _NoUpgradeResponse(aiohttp.ClientResponse):
    """aiohttp hands a bodiless `101` answer's connection back to its pool as reusable when
    the head lacks `Connection: upgrade`, though the server now speaks another protocol on
    it. Close that connection as soon as the head is read."""

    async def start(self, connection: Connection) -> aiohttp.ClientResponse:
        protocol = connection.protocol
        await super().start(connection)
        if self.status < 200 and protocol is not None:
            protocol.close()
        return self


class AiohttpResponse:
    """One upstream answer: read whole or relayed chunk by chunk, then released or aborted."""

    __slots__ = ("_limit", "_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse, limit: int) -> None:
        self._resp = resp
        self._limit = limit
        self.status = resp.status
        self.headers: RawHeaders = resp.raw_headers

    async def read(self) -> bytes:
        parts: list[bytes] = []
        size = 0
        try:
            async for chunk in self._resp.content.iter_any():
                size += len(chunk)
                if size > self._limit:
                    raise UpstreamProtocolError(
                        f"response body larger than {self._limit} bytes")
                parts.append(chunk)
        except aiohttp.ClientError as exc:
            raise _body_error(exc) from None
        except TimeoutError:
            raise UpstreamTimeout("no response bytes within the read timeout") from None
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except aiohttp.ClientError as exc:
            raise _body_error(exc) from None
        except TimeoutError:
            raise UpstreamTimeout("no response bytes within the read timeout") from None

    def at_eof(self) -> bool:
        return self._resp.content.at_eof()

    def release(self) -> None:
        self._resp.release()

    def abort(self) -> None:
        self._resp.close()  # drops the connection: the engine sees the client go


class _ReuseConnector(aiohttp.TCPConnector):
    """A TCPConnector that says, in the calling task's context (`reused`), whether the
    connection it just handed out had carried a request before. (An aiohttp TraceConfig
    says the same, but makes every request send a dozen trace signals: 6% of the gateway's
    CPU per small request.) Connections are remembered weakly, so closed ones go."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reused: ContextVar[bool] = ContextVar("upstream_connection_reused", default=False)
        self._used: weakref.WeakSet[Any] = weakref.WeakSet()

    async def connect(
        self, req: Any, traces: Any, timeout: Any  # noqa: ASYNC109 (aiohttp's own names)
    ) -> Connection:
        conn = await super().connect(req, traces, timeout)
        protocol = conn.protocol
        if protocol is not None:
            self.reused.set(protocol in self._used)
            self._used.add(protocol)
        return conn


class AiohttpUpstream:
    def __init__(self, limits: ClientLimits | None = None) -> None:
        self.limits = limits or ClientLimits()
        self.stale_retries = 0  # requests re-sent after a stale keep-alive connection
        self._session: aiohttp.ClientSession | None = None
        self._connector: _ReuseConnector | None = None

    def _open(self) -> aiohttp.ClientSession:
        # Built on first use, inside the running loop (aiohttp binds its session to it).
        lim = self.limits
        self._connector = connector = _ReuseConnector(
            limit=0, limit_per_host=lim.connections_per_replica,
            keepalive_timeout=lim.idle_s, ttl_dns_cache=60,
        )
        return aiohttp.ClientSession(
            connector=connector, auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            max_line_size=lim.max_line_size, max_field_size=lim.max_field_size,
            max_headers=lim.max_headers,
            cookie_jar=aiohttp.DummyCookieJar(), response_class=_NoUpgradeResponse,
        )

    async def send(
        self, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes | None,
        timeouts: Timeouts,
    ) -> AiohttpResponse:
        session = self._session
        if session is None:
            session = self._session = self._open()
        timeout = aiohttp.ClientTimeout(
            total=timeouts.total_s, connect=timeouts.read_s,
            sock_connect=timeouts.connect_s, sock_read=timeouts.read_s,
        )
        reused = self._connector.reused if self._connector is not None else None
        for attempt in (0, 1):
            if reused is not None:
                reused.set(False)
            try:
                resp = await session.request(
                    method, url, headers=list(headers), data=body, timeout=timeout,
                    allow_redirects=False,
                )
            except _STALE as exc:
                if reused is not None and reused.get() and attempt == 0:
                    self.stale_retries += 1
                    continue
                raise UpstreamConnectError(_describe(exc)) from None
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                raise UpstreamConnectError(_describe(exc)) from None
            except TimeoutError:
                raise UpstreamTimeout("no response head within the timeout") from None
            except aiohttp.ClientResponseError as exc:  # malformed or oversized head
                raise UpstreamProtocolError(f"invalid response head: {exc.message}") from None
            except (aiohttp.ClientError, ValueError) as exc:
                raise UpstreamProtocolError(_describe(exc)) from None
            if resp.status < 200:  # 101 Switching Protocols or another 1xx: never relayed
                resp.close()
                raise UpstreamProtocolError(f"refused an informational answer ({resp.status})")
            return AiohttpResponse(resp, self.limits.max_body_bytes)
        raise AssertionError("unreachable")  # the loop returns or raises

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _body_error(exc: aiohttp.ClientError) -> UpstreamProtocolError | UpstreamTimeout:
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return UpstreamTimeout("no response bytes within the read timeout")
    return UpstreamProtocolError(f"response body cut or malformed: {_describe(exc)}")

