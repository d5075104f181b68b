"""Which session a request belongs to (design.md section 5), pure: header `x-session-id`,
else body `prompt_cache_key`, else body `user`, else none. Empty strings and non-string
values do not name a session."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def resolve_session(header: bytes | None, body: Mapping[str, Any]) -> str | None:
    if header:
        text = header.decode("latin-1").strip()
        if text:
            return text
    for key in ("prompt_cache_key", "user"):
        value = body.get(key)
        if isinstance(value, str) and value:
            return value
    return None
