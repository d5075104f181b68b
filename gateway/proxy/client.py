"""The production `Upstream` (gateway.upstream.seam): aiohttp's client, one session for every
replica, with the rules the relay path needs.

- Pool: keep-alive connections per replica (aiohttp's connector keys them by host and port),
  at most `connections_per_replica` of them. A request over that waits for a free slot at
  most `pool_wait_s`, then fails with `UpstreamPoolBusy` (nothing was sent: the gateway's
  own congestion, answered 503 with Retry-After; never the replica's fault). The slots are
  one `asyncio.Semaphore` per replica origin (so the map is bounded by the fleet: when a
  replica leaves, every origin no live replica has loses its slots, idle pooled connections
  and closing record, `retain_origins`; one a request still on its way made again after is
  dropped at the next departure), taken before aiohttp is asked for a connection and
  given back when the response is released or aborted: the wait for a slot is bounded on
  its own, apart from the connect timeout, and aiohttp's own per-host limit (the same
  number) never queues.
- Delivery: only a failure to open the connection (refused, DNS, socket-connect timeout:
  `ClientConnectorError`, `ConnectionTimeoutError`) is `UpstreamConnectError`, "not
  delivered", which the caller may retry on another replica.
  Once a connection is handed out, any break is "delivered, no answer"
  (`UpstreamProtocolError`): the replica may have read the request, so nothing is re-sent,
  not even on a reused keep-alive connection, whatever the method: aiohttp's own re-send
  of idempotent methods (GET, PUT, DELETE ...) after a broken connection is turned off.
  Stale connections are kept out of use instead: connections idle longer than `idle_s`
  are closed by the connector; keep `idle_s` below the replicas' keep-alive timeout
  (uvicorn, so vLLM: 5 s) so the gateway, not the engine, closes idle connections. And a
  pooled connection is handed out only after a look at its socket (a `poll` of its
  descriptor, no wait, `_PeekingConnector`) shows its peer has not closed it: a server
  that closes after every answer while advertising keep-alive (llama.cpp) has its FIN in
  the kernel before the next request, though asyncio may not have read it yet. What is
  left is a close crossing the request on the wire (a 502), which a loaded machine makes
  likely; a replica whose pooled connections are found closed again and again has each
  answer's connection closed by the gateway instead (`proxy/closing.py`), so its requests
  go out on fresh connections.
- Bytes as the engine wrote them: no Accept-Encoding or User-Agent is added and nothing is
  decompressed (`auto_decompress=False`); a streamed body is handed on as each read
  returns it (`iter_any`), never collected. aiohttp sets TCP_NODELAY on every connection.
- Limits on what comes back: a response head's lines, fields and count are bounded by
  aiohttp's parser (`max_line_size`, `max_field_size`, `max_headers`), a body read whole
  by `max_body_bytes`; an informational or upgrade answer (1xx, e.g. `101 Switching
  Protocols`) is refused as a protocol error and its connection closed.
- Errors: aiohttp's exceptions are translated here, once, into `gateway.upstream.errors`.
"""

from __future__ import annotations

import asyncio
import select
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ConnectionKey
from aiohttp.connector import Connection
from aiohttp.tracing import Trace
from yarl import URL

from gateway.proxy.closing import ClosingPeers, Peer
from gateway.upstream.errors import (
    UpstreamConnectError,
    UpstreamPoolBusy,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.upstream.seam import RawHeaders, Timeouts


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientLimits:
    connections_per_replica: int = 256
    pool_wait_s: float = 10.0  # longest wait for a free connection, then UpstreamPoolBusy
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


class _PeekingConnector(aiohttp.TCPConnector):
    """aiohttp's connector, handing out a pooled connection only while its peer has not
    closed it (module docstring). Overrides aiohttp's `_get`, its one place where a pooled
    connection is taken for reuse, and reads its pool (`_conns`): what it finds is told to
    `closing`; and `_release`, where a connection goes back to the pool, to close instead
    the connections of replicas that close after every answer anyway."""

    def __init__(self, *, closing: ClosingPeers, pooled: Callable[[Peer], bool],
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._closing = closing
        self._pooled = pooled  # False for the origin of a replica that left

    async def _get(self, key: ConnectionKey, traces: list[Trace]) -> Connection | None:
        peer = (key.host, key.port or 0)
        for proto, _ in self._conns.get(key, ()):
            if proto.is_connected():
                break
            # aiohttp already saw this one closed by its peer while it idled (and drops it
            # below, unseen); a close it has not read yet is found by `_peer_open`.
            self._closing.checked(peer, False)
        while True:
            conn = await super()._get(key, traces)
            if conn is None:
                return None
            still_open = _peer_open(conn)
            self._closing.checked(peer, still_open)
            if still_open:
                return conn
            conn.close()  # the peer is gone: never write a request on it

    def _release(self, key: ConnectionKey, protocol: ResponseHandler, *,
                 should_close: bool = False) -> None:
        # aiohttp's one way back into the pool (at an answer's end, often inside the
        # request when the body came with the head): a replica that closes after every
        # answer gets its connection closed here instead (proxy/closing.py).
        peer = (key.host, key.port or 0)
        if not should_close and (not self._pooled(peer) or not self._closing.keep(peer)):
            should_close = True  # (a departed replica's connection is never pooled again)
        super()._release(key, protocol, should_close=should_close)

    def forget(self, host: str, port: int) -> None:
        """Close and drop the idle pooled connections to (host, port): its replica left.
        Connections in use are left to their requests (closed when they end, or pooled
        and then closed by the idle timeout)."""
        for key in [k for k in self._conns if (k.host, k.port) == (host, port)]:
            for proto, _ in self._conns.pop(key, ()):
                proto.close()


def _peer_open(conn: Connection) -> bool:
    transport = conn.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return True
    # One poll of the descriptor, no wait: readable means EOF or bytes nobody asked for,
    # either way not reusable; a reset shows as POLLERR / POLLHUP. (A peek with
    # recv(MSG_PEEK) needs a duplicate socket object under uvloop: 2.8 us against 0.4.)
    watch = select.poll()
    watch.register(sock.fileno(), select.POLLIN)
    return not watch.poll(0)


class AiohttpResponse:
    """One upstream answer: read whole or relayed chunk by chunk, then released or aborted."""

    __slots__ = ("_limit", "_resp", "_slot", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse, limit: int,
                 slot: asyncio.Semaphore | None = None) -> None:
        self._resp = resp
        self._limit = limit
        self._slot = slot  # the pool slot this response holds until released or aborted
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
        self._free()

    def abort(self) -> None:
        self._resp.close()  # drops the connection: the engine sees the client go
        self._free()

    def _free(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()


class AiohttpUpstream:
    def __init__(self, limits: ClientLimits | None = None) -> None:
        self.limits = limits or ClientLimits()
        self._session: aiohttp.ClientSession | None = None
        self._slots: dict[str, asyncio.Semaphore] = {}  # per replica origin (module docstring)
        self._peers: set[Peer] = set()  # (host, port) of each origin in `_slots`
        self._closing = ClosingPeers()

    def _open(self) -> aiohttp.ClientSession:
        # Built on first use, inside the running loop (aiohttp binds its session to it).
        # An aiohttp without the switch of its re-send of idempotent methods (3.10, installed
        # past the pin) would re-send whatever the session says (below): refused here rather
        # than found as a DELETE that reached the engine twice.
        if "_retry_connection" not in aiohttp.ClientSession.ATTRS:
            raise RuntimeError(f"aiohttp {aiohttp.__version__} cannot turn off its re-send "
                               "of idempotent methods; install the pinned version")
        lim = self.limits
        connector = _PeekingConnector(
            limit=0, limit_per_host=lim.connections_per_replica,
            keepalive_timeout=lim.idle_s, ttl_dns_cache=60, closing=self._closing,
            pooled=self._peers.__contains__,
        )
        session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            max_line_size=lim.max_line_size, max_field_size=lim.max_field_size,
            max_headers=lim.max_headers,
            cookie_jar=aiohttp.DummyCookieJar(), response_class=_NoUpgradeResponse,
        )
        # aiohttp re-sends GET, HEAD, OPTIONS, TRACE, PUT and DELETE once when the
        # connection breaks (ServerDisconnectedError, ClientOSError) after the request was
        # written: the engine may have read it and acted (a DELETE that succeeded, then a
        # 404 for the copy). The failure table (upstream/failure.py) alone decides what is
        # sent again. No public switch exists; aiohttp's own test client turns it off the
        # same way, and tests/test_aiohttp_internals.py fails if the attribute moves.
        session._retry_connection = False
        return session

    def retain_origins(self, live: Collection[str]) -> None:
        """Drop the slots, idle pooled connections and closing records of every origin not
        in `live` (module docstring); a request holding a dropped slot gives it back to
        that semaphore, which nothing else reads."""
        connector = self._session.connector if self._session is not None else None
        for gone in [o for o in self._slots if o not in live]:
            del self._slots[gone]
            peer = _peer(URL(gone))
            self._peers.discard(peer)
            self._closing.forget(peer)
            if isinstance(connector, _PeekingConnector):
                connector.forget(*peer)

    async def send(
        self, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes | None,
        timeouts: Timeouts,
    ) -> AiohttpResponse:
        session = self._session
        if session is None:
            session = self._session = self._open()
        target = URL(url)
        slot = await self._slot(target)
        try:
            resp = await self._request(session, method, url, headers, body, timeouts)
        except BaseException:
            slot.release()
            raise
        return AiohttpResponse(resp, self.limits.max_body_bytes, slot)

    async def _slot(self, target: URL) -> asyncio.Semaphore:
        origin = str(target.origin())
        slot = self._slots.get(origin)
        if slot is None:
            slot = self._slots[origin] = asyncio.Semaphore(self.limits.connections_per_replica)
            self._peers.add(_peer(target))
        if not slot.locked():  # a free slot is taken at once: no timer to arm
            await slot.acquire()
            return slot
        try:
            async with asyncio.timeout(self.limits.pool_wait_s):
                await slot.acquire()
        except TimeoutError:
            raise UpstreamPoolBusy(
                f"no free connection within {self.limits.pool_wait_s:g} s") from None
        return slot

    async def _request(
        self, session: aiohttp.ClientSession, method: str, url: str,
        headers: Sequence[tuple[str, str]], body: bytes | None, timeouts: Timeouts,
    ) -> aiohttp.ClientResponse:
        timeout = aiohttp.ClientTimeout(
            total=timeouts.total_s, connect=timeouts.connect_s,
            sock_connect=timeouts.connect_s, sock_read=timeouts.read_s,
        )
        try:
            resp = await session.request(
                method, url, headers=list(headers), data=body, timeout=timeout,
                allow_redirects=False,
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            # refused, DNS, connect timeout: nothing was written
            raise UpstreamConnectError(_describe(exc)) from None
        except TimeoutError:
            raise UpstreamTimeout("no response head within the timeout") from None
        except aiohttp.ClientResponseError as exc:  # malformed or oversized head
            raise UpstreamProtocolError(f"invalid response head: {exc.message}") from None
        except (aiohttp.ClientError, ValueError) as exc:
            # The connection was handed out and the request (maybe) written: delivered.
            raise UpstreamProtocolError(_describe(exc)) from None
        if resp.status < 200:  # 101 Switching Protocols or another 1xx: never relayed
            resp.close()
            raise UpstreamProtocolError(f"refused an informational answer ({resp.status})")
        return resp

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def _peer(target: URL) -> Peer:
    """(host, port) as the connector keys its pool."""
    return (target.host or "", target.port or 0)


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _body_error(exc: aiohttp.ClientError) -> UpstreamProtocolError | UpstreamTimeout:
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return UpstreamTimeout("no response bytes within the read timeout")
    return UpstreamProtocolError(f"response body cut or malformed: {_describe(exc)}")

