"""W3C trace context on the way upstream (pure).

A client's `traceparent` never goes to a replica as the client wrote it: with tracing on,
it is replaced by the gateway span's own context (the replica's spans are children of the
gateway's); with tracing off, it goes only when it is well formed (version 00, lowercase
hex, neither id all zeros: vLLM continues it, so a client's trace still joins the
engine's), with its `tracestate` only then and only when that is well formed and at most
`MAX_TRACESTATE` characters. Anything else is dropped: a malformed value never reaches an
engine that would parse it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
MAX_TRACESTATE = 512  # W3C: a vendor may cut a longer one; 32 members at most
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
# key=value members separated by commas (optional spaces); printable ASCII values
_MEMBER = re.compile(r"[a-z0-9][a-z0-9_\-*/@]{0,255}=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}")

Pairs = Sequence[tuple[str, str]]


def valid_traceparent(value: str | None) -> bool:
    if value is None or _TRACEPARENT.fullmatch(value) is None:
        return False
    trace_id, parent_id = value[3:35], value[36:52]
    return trace_id != "0" * 32 and parent_id != "0" * 16


def valid_tracestate(value: str | None) -> bool:
    if value is None or not value or len(value) > MAX_TRACESTATE:
        return False
    members = [m.strip() for m in value.split(",")]
    return len(members) <= 32 and all(_MEMBER.fullmatch(m) for m in members if m)


def client_context(headers: Pairs) -> tuple[tuple[str, str], ...]:
    """The client's trace headers that may go upstream as they are (tracing off)."""
    parent = _first(headers, "traceparent")
    if not valid_traceparent(parent):
        return ()
    assert parent is not None
    state = _first(headers, "tracestate")
    return (("traceparent", parent),) + (
        (("tracestate", state),) if state is not None and valid_tracestate(state) else ())


def upstream(forwarded: Pairs, context: Pairs) -> list[tuple[str, str]]:
    """The forwarded headers less any trace header, plus `context` (the gateway's)."""
    return [*((k, v) for k, v in forwarded if k.lower() not in TRACE_HEADERS), *context]


def _first(headers: Pairs, name: str) -> str | None:
    return next((v for k, v in headers if k.lower() == name), None)


def from_raw(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The trace headers among an ASGI scope's (lowercase names), decoded."""
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
            if k in (b"traceparent", b"tracestate")]
