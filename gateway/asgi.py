"""The ASGI shapes the gateway and the simulator speak (like starlette/types.py), and the one
helper both use to answer a complete response.

Both are plain ASGI callables rather than framework apps: the relay path is hot (one
request costs well under a millisecond of CPU) and a framework's Request/Response objects
and middleware stack would be most of that budget.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON = b"application/json"


async def respond(
    send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = (),
    content_type: bytes | None = JSON,
) -> None:
    """A whole response: content type (none for None), content length, extra headers."""
    head: Headers = [(b"content-type", content_type)] if content_type is not None else []
    head.append((b"content-length", str(len(body)).encode()))
    head.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
