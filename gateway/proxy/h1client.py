"""A lean HTTP/1.1 client for talking to replicas: an `Upstream` (gateway.proxy.upstream) built on
an asyncio protocol and httptools' C response parser (llhttp, as uvicorn uses for requests).

Why not aiohttp: on the relay path the client is most of the gateway's per-request CPU after
the socket calls themselves. aiohttp builds a request object, a CIMultiDict of headers, a
payload object and a writer task per request; here a request is one bytes join and one
`transport.write`, and the response head and body are parsed in C.

Algorithm:
- Pool: idle keep-alive connections per (scheme, host, port), reused last-in first-out;
  one idle longer than `keepalive_s`, or closed by the server meanwhile (its EOF seen, its
  transport closing), is dropped when met. A connection goes back to the pool only after its
  response was read to the end and both sides allow keep-alive (`Connection: close` from
  the server is honoured); anything else (abort, error, HEAD, body delimited by close)
  closes it.
- Stale connections: servers close idle keep-alive connections on their own (llama.cpp
  after every stream while advertising keep-alive, uvicorn/vLLM after 5 s idle), and the
  close can cross the next request on the wire. A request that fails on a *reused*
  connection before any response byte is sent once more on a fresh connection to the same
  server (`stale_retries` counts them): the server never saw it, and the replica is fine,
  so the caller's cross-replica retry (which would lose the prefix cache) is not involved.
- Head: `send()` writes the request and waits for the response head. A failure before any
  response byte arrived on a fresh connection (refused, reset) is `UpstreamConnectError`:
  the engine never answered, another replica may take the request.
  Garbage is `UpstreamProtocolError`; no head within `connect_s` + `read_s` (or `total_s`) is
  `UpstreamTimeout`.
- Body: `read()` waits for the whole body; `chunks()` yields everything buffered at each
  step (reads are coalesced). Every wait is bounded by `read_s` (the longest silence) and by
  `total_s` when set (probes). Past 256 KiB buffered and unread, the socket stops being read
  until the consumer catches up.
- Informational (1xx) answers are skipped. Requests carry only the caller's headers plus
  Host and Content-Length (no User-Agent, no Accept-Encoding: bytes come back as the engine
  wrote them).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from typing import cast

import httptools

from gateway.proxy.errors import UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from gateway.proxy.upstream import RawHeaders, Timeouts

PoolKey = tuple[str, str, int]
HIGH_WATER = 256 * 1024  # unread body bytes before the socket stops being read
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class _Conn(asyncio.Protocol):
    """One connection; its response state is reset for each request it carries."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_lost: Callable[[_Conn], None]) -> None:
        self.loop = loop
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.peer_closed = False
        self.idle_since = 0.0
        self.waiter: asyncio.Future[None] | None = None
        self.start("GET")

    def start(self, method: str) -> None:
        self.head_only = method == "HEAD"
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.done = False
        self.reusable = True
        self.got_bytes = False
        self.informational = False
        self.until_close = True  # no Content-Length and not chunked: the body ends at EOF
        self.buf: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.flow = False  # a streaming reader: pause the socket past HIGH_WATER
        self.error: Exception | None = None

    # asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.done:  # bytes after a complete answer: never reuse this connection
            self.reusable = False
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"malformed response: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        # The server half-closed (an idle keep-alive it is done with, or a body delimited
        # by the close): never reuse. Returning None lets the transport close itself.
        self.reusable = False
        self.peer_closed = True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        self.on_lost(self)
        if self.done:
            return
        if self.head_done and self.until_close:
            self.done = True  # the body was delimited by the close
            self._wake()
        elif not self.got_bytes:
            self._fail(UpstreamConnectError(
                str(exc) if exc else "the server closed the connection without answering"))
        else:
            self._fail(UpstreamProtocolError(
                str(exc) if exc else "the server closed the connection mid-response"))

    # httptools callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.done:  # a second answer to one request: never reuse this connection
            self.reusable = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.done:
            return
        self.headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length" or (
                lower == b"transfer-encoding" and b"chunked" in value.lower()):
            self.until_close = False

    def on_headers_complete(self) -> None:
        if self.done:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # e.g. 100 Continue: the real answer follows
            self.informational = True
            self.headers = []
            self.until_close = True
            return
        self.status = status
        self.head_done = True
        if status in (204, 304):
            self.until_close = False
        if not self.parser.should_keep_alive():
            self.reusable = False
        if self.head_only:  # no body follows, whatever the headers say
            self.done = True
            self.reusable = False
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.head_only or self.done:
            return
        self.buf.append(body)
        self.buffered += len(body)
        if self.flow and self.buffered > HIGH_WATER and not self.paused and self.transport:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.done:
            return
        if self.informational:
            self.informational = False
            return
        self.done = True
        self._wake()

    # the consumer's side -------------------------------------------------------------------
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def take(self) -> bytes:
        data = self.buf[0] if len(self.buf) == 1 else b"".join(self.buf)
        self.buf = []
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def wait(self, limit_s: float, what: str) -> None:
        """Until the parser moves on (or the connection fails), at most `limit_s` seconds."""
        if limit_s <= 0:
            raise UpstreamTimeout(what)
        fut = self.waiter = self.loop.create_future()
        handle = self.loop.call_later(limit_s, _expire, fut)
        try:
            await fut
        except TimeoutError:
            raise UpstreamTimeout(what) from None
        finally:
            handle.cancel()
            self.waiter = None

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class H1Response:
    __slots__ = ("_client", "_conn", "_deadline", "_key", "_read_s", "headers", "status")

    def __init__(self, client: H1Upstream, key: PoolKey, conn: _Conn, read_s: float,
                 deadline: float | None) -> None:
        self._client = client
        self._key = key
        self._conn = conn
        self._read_s = read_s
        self._deadline = deadline
        self.status = conn.status
        self.headers: RawHeaders = conn.headers

    def _timeout(self) -> float:
        if self._deadline is None:
            return self._read_s
        return min(self._read_s, self._deadline - self._conn.loop.time())

    async def read(self) -> bytes:
        conn = self._conn
        while not conn.done:
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._timeout(), "read timed out")
        return conn.take() if conn.buf else b""

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        conn.flow = True
        while True:
            if conn.buf:
                yield conn.take()
            elif conn.done:
                return
            elif conn.error is not None:
                raise conn.error
            else:
                await conn.wait(self._timeout(), "read timed out")

    def at_eof(self) -> bool:
        return self._conn.done and not self._conn.buf

    def release(self) -> None:
        self._client.done_with(self._key, self._conn)

    def abort(self) -> None:
        self._conn.close()


class H1Upstream:
    """Build inside a running event loop (the app's lifespan)."""

    def __init__(self, *, keepalive_s: float = 30.0) -> None:
        self.keepalive_s = keepalive_s
        self._loop = asyncio.get_running_loop()
        self._idle: dict[PoolKey, list[_Conn]] = {}
        self._open: set[_Conn] = set()
        self._targets: dict[str, tuple[PoolKey, str]] = {}
        self._ssl: ssl.SSLContext | None = None
        self.stale_retries = 0  # requests re-sent after a reused connection proved closed

    def _target(self, url: str) -> tuple[PoolKey, str, str]:
        """(pool key, Host header, path) of an absolute http(s) URL."""
        scheme, sep, rest = url.partition("://")
        netloc, slash, path = rest.partition("/")
        cached = self._targets.get(scheme + "://" + netloc)
        if cached is None:
            if not sep or scheme not in ("http", "https") or not netloc:
                raise UpstreamConnectError(f"unsupported URL {url!r}")
            if netloc.startswith("["):  # [v6]:port
                host, _, port_s = netloc[1:].partition("]")
                port_s = port_s.lstrip(":")
            else:
                host, _, port_s = netloc.rpartition(":") if ":" in netloc else (netloc, "", "")
            port = int(port_s) if port_s.isdigit() else (443 if scheme == "https" else 80)
            cached = self._targets[scheme + "://" + netloc] = ((scheme, host, port), netloc)
        return cached[0], cached[1], "/" + path if slash else "/"

    async def _connect(self, key: PoolKey, limit_s: float) -> _Conn:
        scheme, host, port = key
        context = None
        if scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(limit_s):
                _, conn = await self._loop.create_connection(
                    lambda: _Conn(self._loop, self._open.discard), host, port, ssl=context,
                    server_hostname=host if context else None)
        except TimeoutError:
            raise UpstreamTimeout("timed out connecting") from None
        except OSError as exc:
            raise UpstreamConnectError(str(exc) or type(exc).__name__) from exc
        self._open.add(conn)
        return conn

    def _pooled(self, key: PoolKey) -> _Conn | None:
        idle = self._idle.get(key)
        now = self._loop.time()
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if (not conn.closed and not conn.peer_closed and transport is not None
                    and not transport.is_closing()
                    and now - conn.idle_since < self.keepalive_s):
                return conn
            conn.close()
            self._open.discard(conn)
        return None

    def done_with(self, key: PoolKey, conn: _Conn) -> None:
        if conn.done and conn.reusable and not conn.closed and not conn.buf:
            conn.idle_since = self._loop.time()
            self._idle.setdefault(key, []).append(conn)
        else:
            conn.close()
            self._open.discard(conn)

    async def send(
        self, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes | None,
        timeouts: Timeouts,
    ) -> H1Response:
        key, host, path = self._target(url)
        deadline = None if timeouts.total_s is None else self._loop.time() + timeouts.total_s
        lines = [f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n"]
        lines.extend(f"{k}: {v}\r\n" for k, v in headers)
        if body is not None or method in _BODY_METHODS:
            lines.append(f"Content-Length: {len(body) if body else 0}\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("latin-1")
        request = head + body if body else head
        conn = self._pooled(key)
        if conn is not None:
            try:
                await self._exchange(conn, method, request, timeouts, deadline)
            except UpstreamConnectError:
                # Closed by the server while idle: it never saw this request.
                self.stale_retries += 1
                conn = None
        if conn is None:
            budget = timeouts.connect_s if deadline is None else min(
                timeouts.connect_s, deadline - self._loop.time())
            conn = await self._connect(key, budget)
            await self._exchange(conn, method, request, timeouts, deadline)
        return H1Response(self, key, conn, timeouts.read_s, deadline)

    async def _exchange(self, conn: _Conn, method: str, request: bytes, timeouts: Timeouts,
                        deadline: float | None) -> None:
        """Write the request and wait for the response head; on failure close conn."""
        conn.start(method)
        transport = conn.transport
        assert transport is not None
        try:
            transport.write(request)
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                wait = timeouts.read_s if deadline is None else min(
                    timeouts.read_s, deadline - self._loop.time())
                await conn.wait(wait, "timed out waiting for the response head")
        except BaseException:
            conn.close()
            self._open.discard(conn)
            raise

    async def aclose(self) -> None:
        for conn in self._open:
            conn.close()
        self._open.clear()
        self._idle.clear()
        # let the transports finish closing before the loop goes away
        await asyncio.sleep(0)
