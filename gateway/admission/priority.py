"""A request's class: header `x-gateway-priority: high | normal | low` (default normal),
lowered to its tenant's cap (pure).

The header is checked before it is used: at most 16 bytes, one of the three names
(case-insensitive, surrounding spaces ignored); anything else is a 400, so a typo never
silently becomes `normal`. vLLM's `priority` (lower runs earlier, 0 the default) is
derived from the class only, never from what the client wrote: `stamp` overwrites or
removes the body's `priority` on every body the gateway forwards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.admission.config import CLASSES, Priority
from gateway.upstream.errors import GatewayError

HEADER = b"x-gateway-priority"
_MAX_LEN = 16
_RANK: dict[Priority, int] = {"high": 0, "normal": 1, "low": 2}
# vLLM `priority` per class; `normal` is vLLM's default, so it is never written.
ENGINE_PRIORITY: dict[Priority, int] = {"high": -1, "normal": 0, "low": 1}


def header_value(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The first `x-gateway-priority` value of an ASGI header list."""
    return next((v for k, v in headers if k == HEADER), None)


def requested(raw: bytes | None) -> Priority:
    """The class a header asks for; 400 in OpenAI's shape for anything but the three."""
    if raw is None:
        return "normal"
    text = raw.strip().lower()
    if len(raw) <= _MAX_LEN:
        for cls in CLASSES:
            if text == cls.encode():
                return cls
    raise GatewayError(400, "x-gateway-priority must be one of: high, normal, low.",
                       code="invalid_priority", param="x-gateway-priority")


def capped(cls: Priority, cap: Priority) -> Priority:
    """`cls`, or `cap` when `cls` ranks above it."""
    return cap if _RANK[cls] < _RANK[cap] else cls


def resolve(raw: bytes | None, tenant: str | None, caps: Mapping[str, Priority],
            default_cap: Priority) -> Priority:
    """The class a request runs in: what it asks for, within its tenant's cap."""
    cap = caps.get(tenant, default_cap) if tenant is not None else default_cap
    return capped(requested(raw), cap)


def rank(cls: Priority) -> int:
    """0 for high .. 2 for low."""
    return _RANK[cls]


def stamp(body: dict[str, Any], engine: int | None) -> bool:
    """Replace whatever `priority` the client wrote in `body` by the granted class's
    vLLM priority, or remove it when `engine` is None (vLLM's default 0, which is
    `normal`; a replica without priority scheduling refuses any other value). The
    client's value is never kept, whatever its type. Whether `body` changed."""
    had = "priority" in body
    old = body.pop("priority", None)
    if engine is None:
        return had
    body["priority"] = engine
    return not had or type(old) is not int or old != engine
