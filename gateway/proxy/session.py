"""Which session a request belongs to (design.md section 5), pure: header `x-session-id`,
else body `prompt_cache_key`, else body `user`, else none. Empty strings and non-string
values do not name a session.

A session id is a key of bounded tables (session bindings, hygiene drift state) and is
written to every usage record, so its size is bounded too: an id longer than
`MAX_SESSION_CHARS` is replaced by `sha256:` and its digest, which keeps one session one
id without letting a client store kilobytes per entry."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

MAX_SESSION_CHARS = 256


def resolve_session(header: bytes | None, body: Mapping[str, Any]) -> str | None:
    if header:
        text = header.decode("latin-1").strip()
        if text:
            return bounded(text)
    for key in ("prompt_cache_key", "user"):
        value = body.get(key)
        if isinstance(value, str) and value:
            return bounded(value)
    return None


def bounded(session: str) -> str:
    if len(session) <= MAX_SESSION_CHARS:
        return session
    digest = hashlib.sha256(session.encode("utf-8", "surrogatepass")).hexdigest()
    return f"sha256:{digest}"
