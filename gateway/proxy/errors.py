"""Errors the gateway itself produces, in OpenAI's shape, and the one place where upstream
failures are translated into them.

Exception tree (every upstream transport failure is raised as one of these by the
`gateway.proxy.upstream.Upstream` in use, `gateway.proxy.h1client.H1Upstream` in production; no
transport library's own exception types leak past it):

    GatewayError                 an error answered to the client (status + OpenAI body)
    UpstreamError                talking to a replica failed
    ├── UpstreamConnectError     nothing reached the engine: safe to retry elsewhere
    ├── UpstreamTimeout          no answer in time (the request may be running: no retry)
    └── UpstreamProtocolError    the connection broke or the answer was malformed

Upstream *HTTP* errors (a 4xx/5xx answer from vLLM) are not exceptions: they are relayed
unchanged, status and body.
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
    429: "rate_limit_exceeded",
    414: "invalid_request_error",
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


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamProtocolError(UpstreamError):
    pass


def invalid_field(param: str, expected: str) -> GatewayError:
    return GatewayError(
        400, f"Invalid type for '{param}': expected {expected}.", code="invalid_type", param=param
    )


def missing_field(param: str) -> GatewayError:
    return GatewayError(
        400, f"Missing required parameter: '{param}'.", code="missing_required_parameter",
        param=param,
    )


def from_upstream(exc: UpstreamError, replica: str) -> GatewayError:
    """Map an upstream failure to the status the client sees (502 or 504)."""
    if isinstance(exc, UpstreamTimeout):
        return GatewayError(
            504, f"Replica {replica} did not answer in time.", code="upstream_timeout"
        )
    if isinstance(exc, UpstreamConnectError):
        return GatewayError(
            502, f"Could not connect to replica {replica}: {exc}", code="upstream_connect_error"
        )
    return GatewayError(502, f"Replica {replica} failed: {exc}", code="upstream_protocol_error")
