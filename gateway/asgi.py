"""The ASGI shapes the gateway and the simulator speak (Starlette's), and the one way both
answer a complete response.

Each is a Starlette app for its own routes with its inference paths in front as raw ASGI:
the relay path is hot (one request costs well under a millisecond of CPU) and a
framework's Request objects and middleware stack would be most of that budget. A whole
response, on either side, is a Starlette `Response`.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

__all__ = ["JSON", "Headers", "Message", "Receive", "Scope", "Send", "whole"]

Headers = list[tuple[bytes, bytes]]

JSON = "application/json"


def whole(body: bytes, status: int = 200, headers: Iterable[tuple[bytes, bytes]] = (),
          media_type: str | None = JSON) -> Response:
    """A complete response: content type (none for None), content length, `headers` (raw,
    as the raw-ASGI paths hold them). Returned by Starlette endpoints; awaited with
    (scope, receive, send) on the raw-ASGI paths."""
    response = Response(body, status, media_type=media_type)
    response.raw_headers.extend(headers)
    return response
