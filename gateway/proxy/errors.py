"""Errors the gateway itself produces about a client's request, in OpenAI's shape.

`GatewayError` and the upstream error tree live in `gateway.upstream.errors` (shared with
`gateway.replicas`); they stay importable from here. What each upstream failure allows is
`gateway.upstream.failure`.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.responses import Response

from gateway.asgi import whole
from gateway.upstream.errors import (
    GatewayError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPoolBusy,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.upstream.failure import client_error

__all__ = [
    "GatewayError", "UpstreamConnectError", "UpstreamError", "UpstreamPoolBusy",
    "UpstreamProtocolError", "UpstreamTimeout", "error_response", "from_upstream", "invalid_field",
    "missing_field",
]


def error_response(err: GatewayError, headers: Iterable[tuple[bytes, bytes]] = ()) -> Response:
    """The gateway's one way to answer a whole error: OpenAI's shape, the error's own
    headers (`Retry-After`) and `headers`. Starlette endpoints return it; the raw-ASGI
    path awaits it with its scope, receive and send."""
    return whole(err.body(), err.status, [*err.headers(), *headers])


def invalid_field(param: str, expected: str) -> GatewayError:
    return GatewayError(
        400, f"Invalid type for '{param}': expected {expected}.", code="invalid_type", param=param
    )


def missing_field(param: str) -> GatewayError:
    return GatewayError(
        400, f"Missing required parameter: '{param}'.", code="missing_required_parameter",
        param=param,
    )


def from_upstream(exc: UpstreamError, replica: str | None) -> GatewayError:
    """Map an upstream failure to the status the client sees (502, 503 or 504)."""
    return client_error(exc, replica)
