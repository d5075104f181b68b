"""The gateway's request primitives on top of the shared ASGI shapes (gateway.asgi): read
a bounded request body, pick request headers (a whole error answer is
gateway.proxy.errors.error_response).

A body is bounded in size (413) and in time: a client that stops sending mid-body (a
`content-length` it never fills, a chunk it never finishes) would otherwise hold its
connection and task for ever, so each wait for the next piece is bounded by `idle_s` (408).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gateway.asgi import Headers, Message, Receive, Scope, Send
from gateway.proxy.errors import GatewayError

__all__ = ["Headers", "Message", "Receive", "Scope", "Send"]


def request_headers(scope: Scope, names: Sequence[bytes]) -> list[bytes | None]:
    """Values of the named (lower-case) request headers, first occurrence, None if absent."""
    found: list[bytes | None] = [None] * len(names)
    for key, value in scope["headers"]:
        if key in names:
            i = names.index(key)
            if found[i] is None:
                found[i] = value
    return found


async def read_body(receive: Receive, limit: int, content_length: bytes | None,
                    idle_s: float | None = None) -> bytes:
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            async with asyncio.timeout(idle_s):
                message = await receive()
        except TimeoutError:
            raise GatewayError(
                408, f"The request body did not arrive: nothing for {idle_s:g} s.",
                code="request_body_timeout") from None
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class ClientGone(Exception):
    """The client disconnected while the gateway was still reading its request."""


def too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"Request body larger than {limit} bytes.", code="request_too_large")
