"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol plus the bounds a
server facing untrusted clients needs and it lacks (`gateway serve` passes the class to
uvicorn as `http=`).

- Head size: httptools has no limit on a request head; a client could send megabytes of
  header and the server would keep them. A head larger than `max_head_bytes` is answered
  `431` and the connection closed: measured exactly once the head is parsed, and, for a
  head that spans reads, by the bytes read while it is incomplete, so a huge head is cut
  after one read past the bound instead of being buffered whole.
- Head time: a connection that opens and sends nothing, or a head a byte at a time (the
  slowloris attack), holds a socket and a parser for ever under uvicorn, whose keep-alive
  timer only runs between requests. A head must be complete within `head_timeout_s` of its
  first byte (of the connection, for the first request), else the connection is closed.
- Shape: what the parser refuses (a malformed request line or header, conflicting
  lengths, a bad chunk) gets `400` in OpenAI's error shape, not uvicorn's plain text.

The body's own bounds (size 413, idle time 408) are the request path's
(gateway.proxy.asgi.read_body).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.proxy.errors import GatewayError

_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}


class HeadTooLarge(Exception):
    """Stops the parser at a head over the bound."""


class GatewayHttpProtocol(HttpToolsProtocol):
    max_head_bytes = 64 * 1024
    head_timeout_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._refusal: GatewayError | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse(self._too_large())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # the next request on a kept-alive connection
            self._in_head = True
            self._head_bytes = 0
            self._start_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._stop_head_timer()
        size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
        if size > self.max_head_bytes:
            self._refusal = self._too_large()
            # raised out of the parser's callback, it surfaces in uvicorn's data_received
            # as a parser error: no request cycle starts, send_400_response answers
            raise HeadTooLarge
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        self._refuse(self._refusal or GatewayError(400, msg, code="invalid_http_request"))

    # --------------------------------------------------------------------------------------

    def _too_large(self) -> GatewayError:
        return GatewayError(431, f"The request head is larger than {self.max_head_bytes} "
                            "bytes.", code="request_head_too_large")

    def _refuse(self, error: GatewayError) -> None:
        body = error.body()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (error.status, _REASONS[error.status], len(body),
                                              body))
        self.transport.close()
        self._stop_head_timer()

    def _start_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self.transport.close()


def bounded_protocol(max_head_bytes: int, head_timeout_s: float) -> type[GatewayHttpProtocol]:
    """The protocol class with these bounds (uvicorn instantiates the class it is given)."""
    return type("BoundedGatewayHttpProtocol", (GatewayHttpProtocol,), {
        "max_head_bytes": max_head_bytes, "head_timeout_s": head_timeout_s})
