"""The errors of talking to a replica, and the OpenAI-shaped error the gateway answers.

Exception tree (the `Upstream` in use, `gateway.proxy.client.AiohttpUpstream` in
production, raises only these: no transport library's own exception leaks past it):

    GatewayError                 an error answered to the client (status + OpenAI body)
    UpstreamError                talking to a replica failed
    ├── UpstreamConnectError     not delivered: no byte of the request reached the replica
    │                            (refused, DNS, socket-connect timeout)
    ├── UpstreamPoolBusy         not sent: no free pooled connection within the pool wait
    │                            (the gateway's own congestion, not the replica's fault)
    ├── UpstreamTimeout          delivered, no answer in time (the engine may be running it)
    └── UpstreamProtocolError    delivered, then the connection broke or the answer was
                                 malformed

What each of these allows (retry elsewhere, count against health, what the client is told)
is one table: `gateway.upstream.failure`. Upstream *HTTP* errors (a 4xx/5xx answer from
vLLM) are not exceptions: they are relayed unchanged, status and body.
"""

from __future__ import annotations

from typing import Any

import orjson

# status -> OpenAI error `type`
_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    414: "invalid_request_error",
    429: "rate_limit_exceeded",
    431: "invalid_request_error",
    499: "client_closed_request",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout",
}


class GatewayError(Exception):
    """An error answered by the gateway: `status` plus OpenAI's `{"error": {...}}` body, and
    `retry_after` (seconds, sent as `Retry-After`) when trying again later may succeed."""

    def __init__(
        self, status: int, message: str, *, code: str, param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    def payload(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        return orjson.dumps(self.payload())

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Extra response headers this error carries (`Retry-After`)."""
        if self.retry_after is None:
            return []
        return [(b"retry-after", str(self.retry_after).encode())]

    def sse_events(self) -> bytes:
        """The end of a stream that failed after its first byte: vLLM's own convention."""
        return b"data: " + self.body() + b"\n\ndata: [DONE]\n\n"


class UpstreamError(Exception):
    """Talking to a replica failed (see the module docstring for the subclasses)."""


class UpstreamConnectError(UpstreamError):
    pass


class UpstreamPoolBusy(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamProtocolError(UpstreamError):
    pass
