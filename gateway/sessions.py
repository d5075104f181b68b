"""Which session a request belongs to (design.md section 5), pure: the first of the
configured session headers the request carries, else body `prompt_cache_key`, else body
`user`, else none. Empty strings and non-string values do not name a session.

The headers are read in the order of `[server] session_headers` (gateway.settings
`SESSION_HEADERS`); the default order is the
gateway's own `x-session-id`, then the agent harnesses' own names: Claude Code's
`x-claude-code-session-id`, OpenCode's `x-session-affinity`, Codex's `session-id` and
`session_id` (the names llm-d and the vLLM Router read). A request is expected to carry
one of them; when it carries several, the earliest in the list wins.

A session id is a key of bounded tables (session bindings, hygiene drift state) and is
written to every usage record, so its size is bounded too: an id longer than
`MAX_SESSION_CHARS` is replaced by `sha256:` and its digest, which keeps one session one
id without letting a client store kilobytes per entry."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

MAX_SESSION_CHARS = 256


def session_header(headers: Iterable[tuple[bytes, bytes]], names: Sequence[bytes]
                   ) -> bytes | None:
    """The value of the earliest of `names` (lower-case) present and not blank."""
    found: dict[bytes, bytes] = {}
    for key, value in headers:  # ASGI header names are lower-case
        if key in names and key not in found and value.strip():
            found[key] = value
    for name in names:
        if name in found:
            return found[name]
    return None


def resolve_session(header: bytes | None, body: Mapping[str, Any]) -> str | None:
    """`header`: the value `session_header` chose (None: no session header)."""
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
